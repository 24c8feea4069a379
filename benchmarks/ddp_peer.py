"""PyTorch's DistributedDataParallel on gloo beside mnopt's overlap, in the
same processes and the same run (benchmarks/overlap.py ``--ddp``).

The same MLP as overlap.py's (``layers`` x Linear(width) with ReLU, then
Linear(width, 10), softmax cross-entropy, momentum SGD), the same inputs
(each rank's own), two ways:

- 'ddp sync': forward and backward of a plain module, then the gradients
  averaged in one ``all_reduce`` of their concatenation (the synchronous
  step, the baseline DDP's overlap is measured against);
- 'ddp': DistributedDataParallel with ``bucket_cap_mb`` = mnopt's
  ``bucket_bytes``: each bucket's all-reduce starts during backward.

The threads torch.distributed starts (``DDPPeer.threads``: gloo's loops,
the TCP store's, DDP's own), found by comparing /proc/self/task before and
after ``init_process_group``, the DDP wrapper and the first steps; their
CPU (``thread_cpu``) is what overlap.py sets beside mnopt's averaging
thread.

Needs torch (the .venv/gloo environment of benchmarks/gloo_bench.py)."""

import os

import numpy

from gloo_bench import gloo_here

MODES = ('ddp sync', 'ddp')
#: Where each of ``DDPPeer.threads`` came from, in order.  Threads of the
#: first steps are torch's compute (its intra-op pool), not the reducer.
BIRTHS = ('init_process_group', 'DDP', 'first steps')


def task_comms():
    """{native id: comm name} of this process's threads (/proc)."""
    found = {}
    for name in os.listdir('/proc/self/task'):
        try:
            with open('/proc/self/task/%s/comm' % name) as f:
                found[int(name)] = f.read().strip()
        except OSError:   # it ended meanwhile
            continue
    return found


def thread_cpu_s(tid):
    """Seconds thread ``tid`` of this process has run on a core so far
    (its schedstat); None once it has ended."""
    try:
        with open('/proc/self/task/%d/schedstat' % tid) as f:
            return int(f.read().split()[0]) * 1e-9
    except OSError:
        return None


class DDPPeer(object):

    def __init__(self, world, width, layers, batch, bucket_bytes, rank):
        import torch
        import torch.nn as nn
        from torch.nn.parallel import DistributedDataParallel
        self.torch = torch
        seen = [task_comms()]
        self.dist = gloo_here(world).dist
        seen.append(task_comms())
        self.n = world.size
        rng = numpy.random.RandomState(rank)
        self.x = torch.from_numpy(
            rng.standard_normal((batch, width)).astype(numpy.float32))
        self.t = torch.from_numpy(rng.randint(0, 10, batch).astype(numpy.int64))

        def mlp():
            torch.manual_seed(0)
            mods = []
            for _ in range(layers):
                mods += [nn.Linear(width, width), nn.ReLU()]
            return nn.Sequential(*(mods + [nn.Linear(width, 10)]))

        self.plain = mlp()
        self.ddp = DistributedDataParallel(
            mlp(), bucket_cap_mb=bucket_bytes / float(1 << 20))
        seen.append(task_comms())
        self.opts = {m: torch.optim.SGD(model.parameters(), lr=0.01,
                                        momentum=0.9)
                     for m, model in zip(MODES, (self.plain, self.ddp))}
        for mode in MODES:   # DDP's first iterations build its buckets
            for _ in range(3):
                self.step(mode)
        seen.append(task_comms())
        #: {native id: (comm name, birth)}: the threads each stage of
        #: BIRTHS started, by the name they have now (a thread names
        #: itself once it runs: gloo's workers were 'python' at first).
        self.threads = {
            tid: (seen[-1].get(tid, name), birth)
            for birth, before, after in zip(BIRTHS, seen, seen[1:])
            for tid, name in after.items() if tid not in before}

    def thread_cpu(self):
        """{native id: CPU seconds so far (None: ended)} of ``threads``."""
        return {tid: thread_cpu_s(tid) for tid in self.threads}

    def loss(self, model):
        return self.torch.nn.functional.cross_entropy(model(self.x), self.t)

    def average(self):
        """The plain module's gradients averaged in one all_reduce."""
        grads = [p.grad for p in self.plain.parameters()]
        flat = self.torch.cat([g.view(-1) for g in grads])
        self.dist.all_reduce(flat)
        flat /= self.n
        start = 0
        for g in grads:
            g.view(-1).copy_(flat[start:start + g.numel()])
            start += g.numel()

    def step(self, mode):
        opt = self.opts[mode]
        opt.zero_grad()
        if mode == 'ddp':
            self.loss(self.ddp).backward()
        else:
            self.loss(self.plain).backward()
            self.average()
        opt.step()

    def parts(self, clock, barrier):
        """forward, backward and the averaging of the plain module, each
        alone: seconds, as overlap.py times mnopt's."""
        barrier()
        t0 = clock()
        loss = self.loss(self.plain)
        t1 = clock()
        self.opts['ddp sync'].zero_grad()
        loss.backward()
        t2 = clock()
        barrier()
        t3 = clock()
        self.average()
        t4 = clock()
        return t1 - t0, t2 - t1, t4 - t3
