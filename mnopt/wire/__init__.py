"""How values travel on the wire: the wire dtypes (float16, bfloat16,
float32, float64), their storage and bfloat16's bits (dtypes.py), and the
optional C loops that cast to and from the 16-bit wires and sum them
(_halfcast.c).  Layer 0 (leaves) of docs/architecture.md: the transport
sums with them, the codecs cast with them.
"""
