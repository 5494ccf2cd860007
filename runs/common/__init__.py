"""What the reference runs share: the tiny language model and its synthetic corpus."""
