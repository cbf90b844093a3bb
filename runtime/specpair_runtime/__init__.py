"""specpair runtime: the bundled speculative-decoding runtime."""
