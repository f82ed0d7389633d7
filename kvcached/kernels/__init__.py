"""GPU kernels used to prove and measure elastic KV (Triton; imported lazily)."""
