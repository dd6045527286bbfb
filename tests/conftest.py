"""Suite-wide settings.

torch runs single-threaded in tests: on the 2-core CI machine a second intra-op thread adds
~8 ms to every small op under load, and a fixed thread count keeps reductions in one order.
"""

import torch

torch.set_num_threads(1)
