"""Model building blocks; attention here is the only place that calls kernels."""
