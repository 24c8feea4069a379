"""mnopt on one GPU, each figure against a baseline measured in the same
run, rounds interleaved (run it through benchmarks/gpu_check.sh):

1. codec: pack+cast and unpack of ResNet-50's gradients (162 arrays, 25.6 M
   float32) per wire dtype, against a device-to-device copy of the same
   gradients' bytes.  Bandwidth counts bytes read plus bytes written.  Each
   is timed as a caller sees it, and again with the calls queued behind a
   busy kernel (the GPU's work alone), with the host's time per call.
2. NCCL: allreduce algbw/busbw at N=1 through pure_nccl's call (events
   ordering it on its own stream) beside raw ``cupy.cuda.nccl`` on the same
   buffer and stream.
3. wrapper overhead: training steps of the example's ResNet-50 (images/sec)
   with a plain Chainer optimizer vs mnopt's pure_nccl (+float16 wire,
   +double buffering; overlap=True; shard_state=True), the averaging path
   forced at N=1
   (``skip_single_rank=False``: pack, NCCL, unpack, overflow check), and
   with PowerSGD (rank 4) on pure_nccl.
4. PowerSGD's arithmetic: one compressed step of ResNet-50's gradients
   (rank 4, error feedback, warm start; the sums are the identity, N=1),
   on the GPU beside the same step on the host with NumPy, same run.

Writes gpu_bench.json and gpu_bench.md into --out.
"""

import argparse
import copy
import json
import os
import sys
import time
import traceback

import numpy

import mnopt  # before Chainer: NumPy 2 names for it
from mnopt.codecs import grad_buffer
from mnopt.benchmark.harness import spread
from mnopt.benchmark.workloads import grad_list, resnet50_grad_shapes
from mnopt.transport.nccl import nccl_allreduce_sum, nccl_communicator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'tests'))
from gpu_spin import spin_kernel  # NOQA  (the tests' busy kernel)


def gpu_seconds(cp, fn, reps):
    """Seconds per call of fn, timed with events on the current stream."""
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / 1e3 / reps


def queued_gpu_seconds(cp, fn, reps, spin, spin_ns=50e6):
    """(GPU seconds per call of fn alone, host seconds per call).  The calls
    are queued behind a kernel that keeps the stream busy for ``spin_ns``,
    so the events time the GPU's work without the gaps the host's launches
    leave; the GPU time is None where the host took longer to queue them
    than the spin lasted (or waited for the GPU)."""
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    spin((1,), (1,), (numpy.int64(spin_ns),))
    start.record()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = time.perf_counter() - t0
    stop.record()
    queued_in_time = not start.done
    stop.synchronize()
    gpu = cp.cuda.get_elapsed_time(start, stop) / 1e3 / reps
    return (gpu if queued_in_time else None), host / reps


# ------------------------------------------------------------------ codec

def codec(cp, rounds, reps):
    shapes = resnet50_grad_shapes()
    named = [(n, cp.asarray(g)) for n, g in grad_list(shapes, 0)]
    grads = [g for _, g in named]
    n_elements = sum(g.size for g in grads)
    flat = cp.empty(n_elements, cp.float32)
    src = cp.concatenate([g.reshape(-1) for g in grads])
    wires = ('float32', 'float16', 'bfloat16')
    buffers = {w: grad_buffer.GradBuffer(grad_buffer.make_layout(named, w),
                                         cp) for w in wires}
    spin = spin_kernel()
    calls = {'copy': (lambda: cp.copyto(flat, src), 8 * n_elements)}
    for w in wires:
        buf = buffers[w]
        buf.pack(grads, 2)    # kernels compiled, tables built
        buf.unpack(grads)
        moved = (4 + buf.dtype.itemsize) * n_elements
        calls['pack ' + w] = (lambda buf=buf: buf.pack(grads, 2), moved)
        calls['unpack ' + w] = (lambda buf=buf: buf.unpack(grads), moved)
    spin((1,), (1,), (numpy.int64(1e6),))   # compiled before any timing
    # Per call as a caller sees it (the host launching, the GPU working),
    # and the GPU's work alone (queued behind a spin), with the host's
    # time per call: where that exceeds the GPU's, launches are the limit.
    rows = {name: [] for name in calls}
    alone = {name: [] for name in calls}
    host_us = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (fn, moved) in calls.items():
            rows[name].append(moved / gpu_seconds(cp, fn, reps))
            gpu, host = queued_gpu_seconds(cp, fn, reps, spin)
            alone[name].append(None if gpu is None else moved / gpu)
            host_us[name].append(host * 1e6)
    result = {'arrays': len(grads), 'elements': n_elements, 'rounds': rounds,
              'reps': reps, 'bandwidth': {}, 'ratio_to_copy': {},
              'alone_ratio_to_copy': {}, 'host_us_per_call': {}}
    for name, bws in rows.items():
        result['bandwidth'][name] = spread([b / 1e9 for b in bws])
        result['ratio_to_copy'][name] = spread(
            [b / c for b, c in zip(bws, rows['copy'])])
        pairs = [(b, c) for b, c in zip(alone[name], alone['copy'])
                 if b is not None and c is not None]
        result['alone_ratio_to_copy'][name] = \
            spread([b / c for b, c in pairs]) if pairs else None
        result['host_us_per_call'][name] = spread(host_us[name])
    return result


# ------------------------------------------------------------------ NCCL

def nccl(cp, rounds, reps):
    from cupy.cuda import nccl as libnccl
    from mpi4py import MPI
    comm = nccl_communicator(MPI.COMM_SELF)
    stream = cp.cuda.Stream(non_blocking=True)
    out = []
    for nbytes in (1 << 20, 16 << 20, 4 * 25557096):   # ... ResNet-50
        buf = cp.ones(nbytes // 4, cp.float32)

        def raw():
            comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size,
                           libnccl.NCCL_FLOAT32, libnccl.NCCL_SUM, stream.ptr)

        def ours():
            nccl_allreduce_sum(comm, buf, 'float32', stream)

        times = {'raw': [], 'mnopt': []}
        for _ in range(rounds):
            with stream:
                times['raw'].append(gpu_seconds(cp, raw, reps))
            times['mnopt'].append(gpu_seconds(cp, ours, reps))
        row = {'bytes': nbytes}
        for name, ts in times.items():
            algbw = [nbytes / t / 1e9 for t in ts]
            row[name] = {'algbw_GBps': spread(algbw),
                         'busbw_GBps': 0.0,   # 2(n-1)/n x algbw, n = 1
                         'us_per_call': spread([t * 1e6 for t in ts])}
        out.append(row)
    comm.destroy()
    return out


# ------------------------------------------------------------------ wrapper

def wrapper(cp, rounds, steps, batch, insize):
    import chainer
    sys.path.insert(0, os.path.join(REPO, 'examples', 'imagenet'))
    import models
    base = models.ResNet50(1000)
    base.to_gpu()
    rng = numpy.random.RandomState(0)
    x = cp.asarray(rng.standard_normal((batch, 3, insize, insize))
                   .astype(numpy.float32))
    t = cp.asarray(rng.randint(0, 1000, batch).astype(numpy.int32))

    def make(variant):
        model = copy.deepcopy(base)
        sgd = chainer.optimizers.MomentumSGD(lr=0.01, momentum=0.9)
        if variant == 'plain chainer':
            return model, sgd.setup(model), None
        wire = 'float16' if 'float16' in variant else None
        low_rank = {'compression': 'powersgd', 'powersgd_rank': 4} \
            if 'powersgd' in variant else {}
        comm = mnopt.create_communicator('pure_nccl',
                                         allreduce_grad_dtype=wire,
                                         **low_rank)
        comm.skip_single_rank = False
        opt = mnopt.create_multi_node_optimizer(
            sgd, comm, double_buffering='double' in variant,
            overlap='overlap' in variant,
            shard_state='shard_state' in variant)
        return model, opt.setup(model), comm

    variants = ['plain chainer', 'pure_nccl', 'pure_nccl float16',
                'pure_nccl float16 double buffering', 'pure_nccl overlap',
                'pure_nccl shard_state', 'pure_nccl powersgd r4']
    runs = {}

    def run(variant, n):
        model, opt, _ = runs[variant]
        cp.cuda.Device().synchronize()
        start = time.perf_counter()
        for _ in range(n):
            opt.update(model, x, t)
        if hasattr(opt, 'wait'):
            opt.wait()
        cp.cuda.Device().synchronize()
        return n * batch / (time.perf_counter() - start)

    failed = {}
    for v in list(variants):   # warm up: kernels compiled, first broadcast
        try:
            runs[v] = make(v)
            run(v, 3)
        except Exception as e:   # the others are still measured
            traceback.print_exc()
            failed[v] = '%s: %s' % (type(e).__name__, e)
            variants.remove(v)
            comm = runs.pop(v, (None, None, None))[2]
            if comm is not None:
                try:
                    comm.finalize()
                except Exception:
                    traceback.print_exc()
    rates = {v: [] for v in variants}
    for r in range(rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            rates[v].append(run(v, steps))
    for v in variants:
        if runs[v][2] is not None:
            runs[v][2].finalize()
    plain = rates.get('plain chainer') or [float('nan')] * rounds
    return {'batch': batch, 'insize': insize, 'steps': steps,
            'rounds': rounds, 'cudnn': bool(
                chainer.backends.cuda.cudnn_enabled),
            'failed': failed,
            'images_per_sec': {v: spread(r) for v, r in rates.items()},
            'ratio_to_plain': {v: spread([a / b for a, b in zip(r, plain)])
                               for v, r in rates.items()}}


# ------------------------------------------------------------------ powersgd

def powersgd_arithmetic(cp, rounds, reps, rank=4):
    """Seconds per PowerSGD step of ResNet-50's gradients, the sums left
    out (identity, one rank): the projections, orthogonalization and
    reconstruction a step computes, on the GPU and on the host."""
    from mnopt.codecs import powersgd
    shapes = resnet50_grad_shapes()
    host = [g for _, g in grad_list(shapes, 0)]
    device = [cp.asarray(g) for g in host]

    def stepper(grads, xp):
        state = powersgd.PowerSGDState(shapes, rank=rank, start_iter=0)
        return lambda: powersgd.step(state, grads, lambda a: a, 1, xp)

    gpu_step, host_step = stepper(device, cp), stepper(host, numpy)
    for _ in range(3):               # warm up: kernels compiled, warm Qs
        gpu_step()
    host_step()
    cp.cuda.Device().synchronize()
    gpu, cpu = [], []
    for _ in range(rounds):
        gpu.append(gpu_seconds(cp, gpu_step, reps))
        start = time.perf_counter()
        host_step()
        cpu.append(time.perf_counter() - start)
    entries = powersgd.plan(shapes, rank)
    return {'rank': rank, 'arrays': len(shapes),
            'compressed': sum(e.matrix is not None for e in entries),
            'rounds': rounds, 'reps': reps,
            'gpu_seconds': spread(gpu), 'host_seconds': spread(cpu),
            'host_over_gpu': spread([c / g for c, g in zip(cpu, gpu)])}


# ------------------------------------------------------------------ report

def markdown(res):
    lines = ['GPU: %s; %s' % (res['device'], res['versions']), '']
    c = res['codec']
    lines += ['### Codec: ResNet-50 gradients (%d arrays, %d float32), '
              '%d rounds x %d reps' % (c['arrays'], c['elements'],
                                        c['rounds'], c['reps']), '',
              '| operation | GB/s (min / median / max) | share of copy '
              'bandwidth (min / median / max) | the same, GPU work alone '
              '| host us per call |', '|---|---|---|---|---|']

    def three(r, fmt):
        return 'not measured' if r is None else ' / '.join(
            fmt % r[k] for k in ('min', 'median', 'max'))

    for name, bw in c['bandwidth'].items():
        lines.append('| %s | %s | %s | %s | %s |' % (
            name, three(bw, '%.0f'), three(c['ratio_to_copy'][name], '%.2f'),
            three(c['alone_ratio_to_copy'][name], '%.2f'),
            three(c['host_us_per_call'][name], '%.0f')))
    lines += ['', '"GPU work alone": the calls queued behind a kernel that '
              'keeps the stream busy, so the host\'s launch gaps are not '
              'timed; "not measured" where the host could not queue them '
              'in time.']
    lines += ['', '### NCCL allreduce at N=1 (float32, in place)', '',
              '| bytes | raw cupy.cuda.nccl: us/call, algbw GB/s | mnopt '
              '(pure_nccl call): us/call, algbw GB/s |', '|---|---|---|']
    for row in res['nccl']:
        cells = ['%.1f us, %.0f GB/s' % (row[k]['us_per_call']['median'],
                                         row[k]['algbw_GBps']['median'])
                 for k in ('raw', 'mnopt')]
        lines.append('| %d | %s | %s |' % (row['bytes'], cells[0], cells[1]))
    lines += ['', '(medians; busbw = 2(n-1)/n x algbw = 0 at n = 1)', '']
    w = res['wrapper']
    lines += ['### Wrapper overhead: ResNet-50, batch %d, %dx%d, %d steps '
              'x %d rounds (cuDNN %s)' % (
                  w['batch'], w['insize'], w['insize'], w['steps'],
                  w['rounds'], 'on' if w['cudnn'] else 'off'), '',
              '| optimizer | images/sec (min / median / max) | vs plain '
              '(min / median / max) |', '|---|---|---|']
    for v, ips in w['images_per_sec'].items():
        r = w['ratio_to_plain'][v]
        lines.append('| %s | %.1f / %.1f / %.1f | %.3f / %.3f / %.3f |' % (
            v, ips['min'], ips['median'], ips['max'], r['min'], r['median'],
            r['max']))
    for v, why in w.get('failed', {}).items():
        lines.append('| %s | failed: %s | |' % (v, why.replace('|', '/')))
    p = res.get('powersgd')
    if p:
        lines += ['', '### PowerSGD arithmetic per ResNet-50 step (rank %d, '
                  '%d of %d arrays compressed, sums left out), %d rounds'
                  % (p['rank'], p['compressed'], p['arrays'], p['rounds']),
                  '', '| where | ms per step (min / median / max) |',
                  '|---|---|',
                  '| GPU | %s |' % three({k: v * 1e3 for k, v in
                                          p['gpu_seconds'].items()}, '%.2f'),
                  '| host, NumPy | %s |' % three(
                      {k: v * 1e3 for k, v in p['host_seconds'].items()},
                      '%.1f'),
                  '', 'host / GPU: %s (times as long on the host)' % three(
                      p['host_over_gpu'], '%.1f')]
    return '\n'.join(lines) + '\n'


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--out', default='result/gpu-check')
    p.add_argument('--rounds', type=int, default=5)
    p.add_argument('--reps', type=int, default=50)
    p.add_argument('--steps', type=int, default=10)
    p.add_argument('--batch', type=int, default=32)
    p.add_argument('--insize', type=int, default=224)
    p.add_argument('--only', nargs='*',
                   default=['codec', 'nccl', 'powersgd', 'wrapper'])
    args = p.parse_args(argv)
    import cupy as cp
    from cupy.cuda import nccl as libnccl
    res = {'device': cp.cuda.runtime.getDeviceProperties(0)['name'].decode(),
           'versions': 'CuPy %s, NCCL %s, NumPy %s' % (
               cp.__version__, libnccl.get_version(),
               numpy.__version__), 'command': ' '.join(sys.argv)}
    os.makedirs(args.out, exist_ok=True)

    def save():   # after each section: a later one that fails keeps these
        with open(os.path.join(args.out, 'gpu_bench.json'), 'w') as f:
            json.dump(res, f, indent=1)

    if 'codec' in args.only:
        res['codec'] = codec(cp, args.rounds, args.reps)
        print(json.dumps(res['codec'], indent=1), flush=True)
        save()
    if 'nccl' in args.only:
        res['nccl'] = nccl(cp, args.rounds, args.reps)
        print(json.dumps(res['nccl'], indent=1), flush=True)
        save()
    if 'powersgd' in args.only:
        res['powersgd'] = powersgd_arithmetic(cp, args.rounds, 5)
        print(json.dumps(res['powersgd'], indent=1), flush=True)
        save()
    if 'wrapper' in args.only:
        res['wrapper'] = wrapper(cp, args.rounds, args.steps, args.batch,
                                 args.insize)
        print(json.dumps(res['wrapper'], indent=1), flush=True)
        save()
    if all(k in res for k in ('codec', 'nccl', 'wrapper')):
        text = markdown(res)
        with open(os.path.join(args.out, 'gpu_bench.md'), 'w') as f:
            f.write(text)
        print(text)
    if res.get('wrapper', {}).get('failed'):
        sys.exit('wrapper variants failed: %s'
                 % ', '.join(sorted(res['wrapper']['failed'])))


if __name__ == '__main__':
    main()
