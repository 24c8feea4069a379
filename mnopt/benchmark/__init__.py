"""The benchmark library: workloads, the timing harness and the cases."""
