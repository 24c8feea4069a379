#!/usr/bin/env python
"""The sign codec's CPU cost, its C loops against numpy, side by side.

    python benchmarks/sign_codec.py [--reps 5]

One process, ResNet-50's gradients (25.6M float32): encode (signs, scales
and the error-feedback residual), decode (the voted signs back into the
gradients), and the counting ring's per-step work on 1/8 of the elements
(3-bit counts packed, unpacked, plus this rank's bits).  Medians.
"""

import argparse
import time

import numpy

from mnopt.codecs import grad_buffer, sign
from mnopt.benchmark.workloads import resnet50_grad_shapes


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--reps', type=int, default=5)
    args = p.parse_args()
    if sign._signbits is None:
        raise SystemExit('mnopt.codecs._signbits is not built '
                         '(pip install -e .)')
    rng = numpy.random.RandomState(0)
    grads = [rng.standard_normal(s).astype(numpy.float32)
             for s in resnet50_grad_shapes()]
    layout = grad_buffer.make_layout(
        [('p%d' % i, g) for i, g in enumerate(grads)], 'float32')
    loops = {'C': sign._signbits, 'numpy': None}
    codecs = {name: sign.SignCodec(layout) for name in loops}
    times = {name: [] for name in loops}
    for rep in range(args.reps):
        for name, module in loops.items():  # alternate: drift hits both
            sign._signbits = module
            codec = codecs[name]
            t0 = time.perf_counter()
            bits, scales = codec.encode(grads, rep)
            t1 = time.perf_counter()
            codec.decode(bits, scales.astype(numpy.float32), grads)
            t2 = time.perf_counter()
            counts = numpy.zeros(codec.total // 8, numpy.uint8)
            sign.add_bits(counts, bits, 0)
            packed = sign.pack_counts(counts, 3)
            sign.unpack_counts(packed, 3, counts.size, numpy.uint8)
            t3 = time.perf_counter()
            times[name].append((t1 - t0, t2 - t1, t3 - t2))
    sign._signbits = loops['C']
    med = {name: numpy.median(numpy.array(t), axis=0)
           for name, t in times.items()}
    print('| loops | encode s | decode s | ring step on 1/8 s |')
    print('|---|---|---|---|')
    for name, m in med.items():
        print('| %s | %.3f | %.3f | %.4f |' % ((name,) + tuple(m)))
    print('| numpy / C | %.1fx | %.1fx | %.1fx |'
          % tuple(med['numpy'] / med['C']))


if __name__ == '__main__':
    main()
