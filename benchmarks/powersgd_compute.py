"""PowerSGD's arithmetic alone, one process, no communication: where a
compressed step's CPU time goes, mnopt's core beside PyTorch's hook.

    OMP_NUM_THREADS=1 .venv/gloo/bin/python benchmarks/powersgd_compute.py \\
        --reps 3 [--max-mb 10] [--json out.json]

Why: on the simulated cluster 8 ranks share 2 cores, so a compressed
step's compute can cost more than the bytes it saves.  This times, on
ResNet-50's gradient shapes, one thread:

- mnopt (mnopt/codecs/powersgd.py, the calls low_rank.py makes per step):
  ``project`` (M = grad + residual, P = M Q), ``reproject`` (Gram-Schmidt
  of P, Q = M^T P), ``reconstruct`` (M_hat = P Q^T by rank-one terms,
  residual M - M_hat, warm Qs kept, dead columns checked) and the copy of
  the means back into the gradients;
- the same mathematics written with torch's tensors the way
  ``powerSGD_hook`` does it (one contiguous buffer per step, ``matmul``
  for both products and for P Q^T, ``torch.linalg.qr`` for rank > 2):
  the hook's own function needs a process group and a DDP bucket, so
  this is its arithmetic, not its code.  Omitted without torch.

and, for scale, one pass over the gradients (a float32 copy), which is
what plain averaging's packing costs per direction.
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                '..'))
from mnopt.codecs import powersgd  # NOQA
from mnopt.benchmark.workloads import grad_list, resnet50_grad_shapes  # NOQA


def timed(fn, reps):
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return {'min': min(out), 'median': statistics.median(out),
            'max': max(out)}


def copy_once(shapes, reps):
    """One float32 copy of the gradients: a pass over them."""
    grads = [g for _, g in grad_list(shapes, 0)]
    return timed(lambda: [g.copy() for g in grads], reps)


def mnopt_phases(shapes, rank, reps):
    grads = [g for _, g in grad_list(shapes, 0)]
    state = powersgd.PowerSGDState(shapes, rank=rank, start_iter=0)
    phases = {'project': [], 'reproject': [], 'reconstruct': [],
              'copy back': []}
    for _ in range(reps + 1):   # the first: no residuals, no warm Qs yet
        t0 = time.perf_counter()
        matrices, ps, plain = powersgd.project(state, grads)
        t1 = time.perf_counter()
        ps, qs = powersgd.reproject(state, matrices, ps)
        t2 = time.perf_counter()
        means = powersgd.reconstruct(state, grads, matrices, ps, qs, {}, 1)
        t3 = time.perf_counter()
        for i in matrices:
            grads[i][...] = means[i]
        t4 = time.perf_counter()
        for name, a, b in (('project', t0, t1), ('reproject', t1, t2),
                           ('reconstruct', t2, t3), ('copy back', t3, t4)):
            phases[name].append(b - a)
    return {k: {'median': statistics.median(v[1:]), 'min': min(v[1:])}
            for k, v in phases.items()}


def reconstruct_pieces(shapes, rank, reps):
    """reconstruct's parts, each over every compressed matrix: outer_sum
    (P Q^T by rank-one terms), the same as one matmul, the residual."""
    grads = [g for _, g in grad_list(shapes, 0)]
    state = powersgd.PowerSGDState(shapes, rank=rank, start_iter=0)
    matrices, ps, _ = powersgd.project(state, grads)
    ps, qs = powersgd.reproject(state, matrices, ps)
    keys = sorted(matrices)
    out = {}
    out['outer_sum (rank-one terms)'] = timed(
        lambda: [powersgd.outer_sum(ps[i], qs[i]) for i in keys], reps)
    out['P @ Q.T (BLAS, for comparison)'] = timed(
        lambda: [numpy.matmul(ps[i], qs[i].T) for i in keys], reps)
    hats = {i: powersgd.outer_sum(ps[i], qs[i]) for i in keys}
    out['residual M - M_hat'] = timed(
        lambda: [matrices[i] - hats[i] for i in keys], reps)
    out['orthogonalize (Gram-Schmidt)'] = timed(
        lambda: [powersgd.orthogonalize(ps[i]) for i in keys], reps)
    out['M Q and M^T P (BLAS)'] = timed(
        lambda: [(numpy.matmul(matrices[i], qs[i]),
                  numpy.matmul(matrices[i].T, ps[i])) for i in keys], reps)
    return out


def torch_phases(shapes, rank, reps):
    import torch
    torch.set_num_threads(1)
    plan = powersgd.plan(shapes, rank)
    grads = [torch.from_numpy(g) for _, g in grad_list(shapes, 0)]
    comp = [e for e in plan if e.matrix is not None]
    errors = [torch.zeros(e.matrix) for e in comp]
    qs = [torch.randn(e.matrix[1], e.rank) for e in comp]

    def step():
        # The hook: residual added, P = M Q into one buffer, QR, Q = M^T P,
        # M_hat = P Q^T, residual kept, copied back.
        ms = [g.view(e.matrix) + err
              for g, e, err in zip((grads[e.index] for e in comp), comp,
                                   errors)]
        ps = [torch.matmul(m, q) for m, q in zip(ms, qs)]
        for p in ps:
            if p.shape[1] <= 2:
                p /= p.norm(dim=0).clamp_min(1e-30)   # stand-in for its GS
            else:
                torch.linalg.qr(p, out=(p, torch.empty(p.shape[1],
                                                       p.shape[1])))
        new_q = [torch.matmul(m.t(), p) for m, p in zip(ms, ps)]
        for k, (m, p, q) in enumerate(zip(ms, ps, new_q)):
            hat = torch.matmul(p, q.t())
            errors[k] = m - hat
            grads[comp[k].index].view(comp[k].matrix).copy_(hat)
            qs[k] = q
    step()
    return {'whole step': timed(step, reps)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--reps', type=int, default=3)
    p.add_argument('--ranks', type=int, nargs='*', default=[4, 1])
    p.add_argument('--max-mb', type=float)
    p.add_argument('--json')
    args = p.parse_args()
    shapes = resnet50_grad_shapes()
    if args.max_mb:   # the first shapes up to that size, as powersgd_bench
        sizes = numpy.cumsum([4 * int(numpy.prod(s)) for s in shapes])
        shapes = shapes[:int(numpy.searchsorted(sizes, args.max_mb * 1e6,
                                                side='right'))]
    result = {'bytes': 4 * sum(int(numpy.prod(s)) for s in shapes),
              'threads': os.environ.get('OMP_NUM_THREADS'),
              'copy_once': copy_once(shapes, args.reps), 'ranks': {}}
    for rank in args.ranks:
        row = {'mnopt': mnopt_phases(shapes, rank, args.reps),
               'mnopt reconstruct pieces': reconstruct_pieces(
                   shapes, rank, args.reps)}
        row['mnopt total'] = sum(v['median'] for v in row['mnopt'].values())
        try:
            row['torch'] = torch_phases(shapes, rank, args.reps)
        except ImportError:
            row['torch'] = None
        result['ranks'][rank] = row
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(result, f, indent=1)


if __name__ == '__main__':
    main()
