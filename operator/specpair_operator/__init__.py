"""specpair operator: reconciles SpeculativePair objects."""
