"""Pure encode/decode of the on-disk format: bytes in, bytes out. No I/O, no torch."""
