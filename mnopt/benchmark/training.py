"""Training steps with SIMULATED compute: double buffering's overlap, and
per-step time for scaling across node counts."""

import time

import numpy

from mnopt.benchmark import harness
from mnopt.benchmark.workloads import grad_model, resnet50_grad_shapes


STEPS_PER_BLOCK = 16


def simulated_update():
    """A Chainer optimizer whose update runs elsewhere (on a GPU): it counts
    updates and leaves the CPU alone.  A real ``chainer.Optimizer``, as
    ``create_multi_node_optimizer`` requires."""
    import chainer

    class SimulatedUpdate(chainer.Optimizer):
        def update(self, lossfun=None, *args, **kwds):
            self.t += 1

    return SimulatedUpdate()


def _simulated_steps(model, opt, grad_sets, compute_s, drain=True):
    """STEPS_PER_BLOCK training steps whose forward, backward and update are
    SIMULATED by sleeping ``compute_s``; backward's fresh gradients are two
    alternating sets of arrays, handed over by assignment as backward does.
    With ``drain`` the block ends with nothing in flight, so no work leaks
    into the next measurement; without it, consecutive blocks of one case
    form a steady-state run (each pays for what the previous left)."""
    params = [p for _, p in sorted(model.namedparams())]

    def steps():
        for k in range(STEPS_PER_BLOCK):
            time.sleep(compute_s)
            for p, g in zip(params, grad_sets[k % 2]):
                p.grad = g
            opt.update()
        if drain and hasattr(opt, 'wait'):
            opt.wait()
    steps.optimizer = opt
    return steps


def double_buffering(args, world):
    """Step time with simulated compute as long as the averaging: plain
    (compute + averaging) against double buffering (overlapped)."""
    import mnopt
    shapes = resnet50_grad_shapes()
    comm = mnopt.create_communicator(args.communicators[0],
                                     allreduce_grad_dtype=args.dtypes[0])

    def gradients(seed):
        model = grad_model(shapes, world.rank + 1000 * seed)
        return [p.grad for _, p in sorted(model.namedparams())]
    grad_sets = [gradients(0), gradients(1)]

    def steps(compute_s, **kw):
        model = grad_model(shapes, world.rank)
        opt = mnopt.create_multi_node_optimizer(simulated_update(), comm,
                                                **kw).setup(model)
        return _simulated_steps(model, opt, grad_sets, compute_s)

    # The averaging alone: the same steps with no compute at all.
    mean = ('averaging alone', 'comm', steps(0.0))
    probe = harness.run_cases([mean], world, 3)
    compute_s = float(numpy.median(probe)) / STEPS_PER_BLOCK
    cases = [mean,
             ('step, plain', 'plain', steps(compute_s)),
             ('step, double buffering', 'double_buffering',
              steps(compute_s, double_buffering=True))]
    times = harness.run_cases(cases, world, args.reps) / STEPS_PER_BLOCK
    med = dict((c[1], m) for c, m in zip(cases, numpy.median(times, axis=1)))
    if world.rank != 0:
        return None
    harness.print_heading(
        'double buffering: %s %s, N=%d, ResNet-50 gradients; per step, over '
        'blocks of %d steps, %d repetitions after %d warm-up; compute '
        'SIMULATED: sleep %.1f ms per step (forward + backward + update)'
        % (comm.name, comm.allreduce_grad_dtype or 'float32', world.size,
           STEPS_PER_BLOCK, args.reps, harness.WARMUP, compute_s * 1e3))
    for (label, kind, _), row in zip(cases, times):
        print('%-26s %8.1f ms  (min %.1f, max %.1f)' % (
            label, med[kind] * 1e3, row.min() * 1e3, row.max() * 1e3))
    longer = max(compute_s, med['comm'])
    shorter = min(compute_s, med['comm'])
    result = {
        'compute_s': compute_s, 'median_s': med,
        'plain_over_sum': med['plain'] / (compute_s + med['comm']),
        'db_over_max': med['double_buffering'] / longer,
        'hidden_fraction': (compute_s + med['comm']
                            - med['double_buffering']) / shorter}
    print('plain step / (compute + averaging)       = %.2f' %
          result['plain_over_sum'])
    print('double-buffered step / max(compute, avg.) = %.2f  (goal <= 1.15)'
          % result['db_over_max'])
    print('fraction of the shorter part hidden       = %.2f  (goal >= 0.85)'
          % result['hidden_fraction'])
    return result


def scaling(args, world):
    """Per-step time with a fixed SIMULATED compute per step: plain float32
    averaging against double buffering with float16 on the wire.  Run it
    at several node counts; efficiency e = t / (t0 n) = step(1) / step(n)
    (ChainerMN's definition, throughput t on n nodes, t0 on one)."""
    import mnopt
    shapes = resnet50_grad_shapes()
    compute_s = args.compute_ms / 1e3
    grad_sets = [[p.grad for _, p in sorted(grad_model(
        shapes, world.rank + 1000 * seed).namedparams())] for seed in (0, 1)]

    def steps(wire, **kw):
        comm = mnopt.create_communicator(args.communicators[0],
                                         allreduce_grad_dtype=wire)
        model = grad_model(shapes, world.rank)
        opt = mnopt.create_multi_node_optimizer(simulated_update(), comm,
                                                **kw).setup(model)
        return _simulated_steps(model, opt, grad_sets, compute_s,
                                drain=False)
    cases = [('plain, float32', 'plain_fp32', steps('float32')),
             ('double buffering, float16', 'db_fp16',
              steps('float16', double_buffering=True))]
    # One case at a time: its blocks form one steady-state run, drained
    # before the next case starts.
    times = []
    for case in cases:
        times.append(harness.run_cases([case], world, args.reps, warmup=1)[0]
                     / STEPS_PER_BLOCK)
        opt = case[2].optimizer
        if hasattr(opt, 'wait'):
            opt.wait()
    probe = mnopt.create_communicator('flat')
    result = {'n_ranks': world.size, 'n_nodes': probe.inter_size,
              'compute_s': compute_s, 'communicator': args.communicators[0],
              'steps': {k: float(numpy.median(t))
                        for (_, k, _), t in zip(cases, times)}}
    if world.rank == 0:
        harness.print_heading(
            'scaling: %d node%s x %d rank%s, %s, compute SIMULATED %.0f ms '
            'per step, %d repetitions after 1 warm-up' % (
                probe.inter_size, '' if probe.inter_size == 1 else 's',
                probe.intra_size, '' if probe.intra_size == 1 else 's',
                args.communicators[0], args.compute_ms, args.reps))
        for (label, kind, _), t in zip(cases, times):
            print('%-28s %8.1f ms per step (min %.1f, max %.1f)' % (
                label, result['steps'][kind] * 1e3, t.min() * 1e3,
                t.max() * 1e3))
    return result
