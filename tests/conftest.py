"""Suite-wide settings.

gRPC core logs only errors; Triton kernels run in the interpreter (on CPU). torch runs single-threaded in tests: on the
2-core CI machine a second intra-op thread adds ~8 ms to every small op under load, and a fixed thread count keeps
reductions in one order.
"""

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # gRPC core logs every GOAWAY at INFO otherwise
os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels run on CPU; must precede any import of triton

import torch  # noqa: E402

torch.set_num_threads(1)
