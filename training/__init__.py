"""Training of the bundled small model (docs/architecture.md §9): corpus, tokenizer, config, trunk and
draft training, export, and the end-to-end demo. Owns how `assets/dspark-small` is made; the
services never import it, and CI never trains (it only tests the training forwards)."""
