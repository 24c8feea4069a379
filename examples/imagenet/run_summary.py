"""What the ImageNet example says of a run: the modes it runs in (the
header's and the closing ``== mnopt:`` line's, from one function, so the
two name the same), and the summary at the end, of this run alone (a
resumed run's iterations before the resume are counted apart)."""

import os
import textwrap
import time

import chainer
from chainer import training
import numpy

import plots


#: Where a summary line's continuation starts: under the first line's text.
INDENT = ' ' * 11


def wrapped(line, width=80):
    """``line`` within ``width`` columns, continued under its text, as the
    table's legend is (a path longer than a line stays whole, on a line of
    its own, so it can be copied)."""
    return textwrap.fill(line, width, subsequent_indent=INDENT,
                         break_long_words=False, break_on_hyphens=False)


def modes(args, comm):
    """The modes of the run, as ', '-separated phrases: the wire, the
    compression and its rank, double buffering or overlap, sharded state,
    multi-node batch normalization."""
    said = ['wire %s' % (comm.allreduce_grad_dtype or 'float32')]
    if args.compression:
        said.append('%s compression%s%s' % (
            args.compression,
            ' rank %d' % (args.powersgd_rank or 1)
            if args.compression != 'sign' else '',
            ' after %d plain steps' % args.warmup_steps
            if args.warmup_steps else ''))
    if args.double_buffering:
        said.append('double buffering')
    if args.overlap:
        said.append('overlap')
    if args.shard_state:
        said.append('sharded optimizer state')
    if getattr(args, 'accumulation_steps', 1) > 1:
        said.append('an update every %d iterations' % args.accumulation_steps)
    if args.mnbn:
        said.append('multi-node batch normalization')
    return ', '.join(said)


class Throughput(training.Extension):
    """Reports images per second (all ranks together) and the seconds per
    iteration each rank spent blocked in gradient averaging; keeps each
    step's time and blocked time of this run for the summary at the
    end."""

    trigger = (1, 'iteration')
    priority = training.PRIORITY_WRITER

    def __init__(self, optimizer, images_per_iteration):
        self._optimizer = optimizer
        self._images = images_per_iteration
        self._last = None
        self.steps = []     #: (seconds, seconds blocked in averaging)
        self.first_iteration = None   #: the iteration this run began at
        self.started = None           #: when (time.perf_counter())

    def initialize(self, trainer):
        # After a resume: the snapshot's iteration.
        self.first_iteration = trainer.updater.iteration
        self.started = time.perf_counter()

    def __call__(self, trainer):
        now = time.perf_counter()
        comm_time = self._optimizer.communication_time
        if self._last is not None:
            t, c = self._last
            self.steps.append((now - t, comm_time - c))
            chainer.report({'images/sec': self._images / max(now - t, 1e-9),
                            'averaging_s/iter': comm_time - c})
        self._last = (now, comm_time)


def _size(nbytes):
    for unit, scale in (('GiB', 1 << 30), ('MiB', 1 << 20), ('KiB', 1 << 10)):
        if nbytes >= scale:
            return '%.3g %s' % (nbytes / scale, unit)
    return '%d B' % nbytes


def _training_line(trainer, comm, args, throughput, steps, elapsed):
    ran = trainer.updater.iteration - throughput.first_iteration
    before = ('' if not throughput.first_iteration else
              ' (%d before the resume)' % throughput.first_iteration)
    images = args.batchsize * comm.size
    # The median step: validation and snapshots fall into a few steps.
    per_rank = [numpy.median([t for t, _ in s]) for s in steps if s]
    if per_rank:
        step = float(numpy.median(per_rank))
        rate = '%.0f images/s (median step %.3f s, %d images)' % (
            images / step, step, images)
    elif ran:
        rate = '%.0f images/s (%d images a step)' % (
            images * ran / elapsed, images)
    else:
        rate = 'nothing to train (the snapshot is at the end)'
    return 'training   %d iteration%s this run%s in %.1f s: %s' % (
        ran, '' if ran == 1 else 's', before, elapsed, rate)


def compression_line(comm, args, report, gradient_bytes):
    """PowerSGD's bytes per step against the plain gradients'
    (``gradient_bytes``: all of them, in the wire dtype), and what 'auto'
    chose; None without PowerSGD (or no step reported)."""
    if args.compression not in ('powersgd', 'auto') or not report or \
            not report.totals['steps']:
        return None
    model_bytes = gradient_bytes
    sent = report.totals['bytes'] / report.totals['steps']
    line = ('compression %s a step on the wire against %s plain (%.1f%%)'
            % (_size(sent), _size(model_bytes),
               100.0 * sent / max(model_bytes, 1)))
    low_rank = getattr(comm.averaging, 'low_rank', None)
    guard = getattr(low_rank, 'guard', None)
    if args.compression == 'auto' and guard is not None:
        chosen = list(guard.choices.values())
        line += '; ' + auto_choices(chosen, saved=sent < model_bytes)
    return line


def auto_choices(chosen, saved):
    """What 'auto' chose (``chosen``: 'compressed' or another word per
    gradient set), and where it chose plain throughout though bytes were
    ``saved``, that they were saved in its trial steps."""
    if not chosen:
        return ('auto had not chosen yet (it times each gradient set both '
                'ways first)')
    compressed = sum(c == 'compressed' for c in chosen)
    sets = ('the gradient set' if len(chosen) == 1 else
            'both gradient sets' if len(chosen) == 2 else
            'all %d gradient sets' % len(chosen))
    if compressed == 0:
        return 'auto chose plain for %s%s' % (
            sets, ' (the bytes saved are its trial steps\', compressed '
            'to time them)' if saved else '')
    if compressed == len(chosen):
        return 'auto chose PowerSGD for %s' % sets
    return 'auto chose PowerSGD for %d of %d gradient sets, plain for the ' \
        'rest' % (compressed, len(chosen))


def summary(trainer, comm, args, throughput, averaging_seconds, elapsed,
            report=None, snapshot=None, gradient_bytes=0):
    """What mnopt did in this run, in a few lines (rank 0 prints them):
    ``report`` the CommunicationReport, ``snapshot`` the path of this
    run's last snapshot, ``gradient_bytes`` the gradients' in the wire
    dtype."""
    steps = comm.gather_obj(throughput.steps)
    averaged = comm.gather_obj(averaging_seconds)
    if comm.rank != 0:
        return None
    total = sum(t for s in steps for t, _ in s)
    blocked = sum(b for s in steps for _, b in s)
    counted = max(1, sum(len(s) for s in steps))
    took = sum(averaged)
    log = trainer.get_extension('LogReport').log
    last = next((e for e in reversed(log)
                 if 'validation/main/accuracy' in e), {})
    hidden = ('overlap' if args.overlap else 'double buffering'
              if args.double_buffering else None)
    trained = trainer.updater.iteration > throughput.first_iteration
    lines = [
        '== mnopt: %d ranks, communicator %s, %s'
        % (comm.size, comm.name, modes(args, comm)),
        _training_line(trainer, comm, args, throughput, steps, elapsed),
        'averaging  %.1f%% of step time blocked in averaging (%.3f s per '
        'step)' % (100.0 * blocked / max(total, 1e-9), blocked / counted)
        if trained else 'averaging  none: nothing was trained this run',
    ]
    if hidden and trained:
        lines.append('           %s hid %.0f%% of the %.3f s averaging took '
                     'per step' % (hidden, 100.0 * max(0.0, took - blocked)
                                   / max(took, 1e-9), took / counted))
    compressed = compression_line(comm, args, report, gradient_bytes)
    if compressed:
        lines.append(compressed)
    if last:
        lines.append('validation accuracy %.3f, loss %.3f (iteration %d, '
                     'epoch %d; chance %.3f)' % (
                         last['validation/main/accuracy'],
                         last['validation/main/loss'], last['iteration'],
                         last['epoch'], 1.0 / args.n_classes))
    out = args.out
    drawn = [f for f, _ in plots.FIGURES
             if args.plot and os.path.exists(os.path.join(out, f))]
    if drawn:
        lines.append('plots      %s in %s' % (', '.join(drawn), out))
    if snapshot:
        lines.append('snapshot   %s (--resume auto continues from it)'
                     % snapshot)
    text = '\n'.join(wrapped(line) for line in lines)
    print(text, flush=True)
    return text
