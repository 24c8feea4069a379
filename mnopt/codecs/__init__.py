"""The codecs: what a gradient set becomes on the wire and back.  Packing,
casting and bucketing (grad_buffer.py), sign compression with its C
loops (sign.py, _signbits.c), PowerSGD's low-rank arithmetic
(powersgd.py), and overflow on 16-bit wires (overflow.py).  No codec
averages anything itself: the communicators call them.  Layer 3 (codecs)
of docs/architecture.md.
"""
