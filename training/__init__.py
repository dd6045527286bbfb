"""Training of the bundled small model (issue #7): corpus, tokenizer, config, trunk training."""
