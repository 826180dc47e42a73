"""Training-time ops (differentiable kernels and their torch references)."""
