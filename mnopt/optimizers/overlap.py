"""Averaging during backward: the identity nodes that find a gradient
final, the buckets and their plan (``create_multi_node_optimizer(...,
overlap=True)``: mnopt/optimizers/overlap_optimizer.py; ZeRO stage 2
extends it: mnopt/optimizers/zero/stage2.py).  Overlap without staleness:
the optimizer updates with the exact mean.

How a gradient is known to be final.  Chainer 7 has no per-parameter hook
and sets leaf gradients only when backward ends.  So while the optimizer
runs the forward pass (``update(lossfun, ...)``), a LinkHook gives each
link's forward, in place of each of the link's own parameters, the output
of a ``_Ready`` node: the identity of (parameter, the link's input).
Everything the link computes from the parameter flows through that node,
and Chainer's backward runs a function node only once the gradients of all
its outputs are complete (it visits nodes by decreasing rank, and every
consumer of a node's output ranks above it).  The gradient ``_Ready``
receives is therefore the parameter's whole gradient from that link call.
The link's input is an input of the node only to rank it just above that
input: with the parameter alone its rank would be 1, and Chainer would
visit every such node at the very end of backward.

What the nodes cannot vouch for is averaged after backward, with the rest:
a parameter wrapped more than once in a forward pass (weight sharing, an
unrolled RNN), one whose final gradient is not the array its node received
(it was also used outside its link's forward), and one no node fired for
(unused this iteration: zero-filled, as without overlap).

Buckets follow backward order (the reverse of first use in forward) and
each closes once it holds ``bucket_bytes``.  The plan is made from one
iteration's forward pass, checked to be the same on every rank, and used
from the next iteration on (with a comm hook, from that one:
``check_plan`` after its update's exchange); buckets are handed to the communicator in plan order, so
every rank starts the same averagings in the same order: each is checked
across ranks like any other, and a rank whose graph differs gets an error,
as do the others, never a hang.

Only Chainer's public API is used: LinkHook, FunctionNode, and a link's
parameters being its attributes (``with self.init_scope(): self.W = ...``;
the hook swaps the attribute's value in the link's ``__dict__`` for the
duration of its forward and puts it back after, or when the forward pass
raises).
"""

import collections

import chainer

from mnopt.timeline import recorder as timelines


class _Ready(chainer.FunctionNode):
    """Identity of its first input; the other (the link's input) sets only
    its rank.  Its backward reports the first input's gradient, and passes
    it on to the parameter unless the report returns False."""

    def __init__(self, report, name):
        super(_Ready, self).__init__()
        self._report, self._name = report, name

    def forward(self, inputs):
        self.retain_inputs(())
        return inputs[0],

    def backward(self, indexes, grad_outputs):
        gy, = grad_outputs
        if gy is not None and self._report(self._name, gy.array) is False:
            # The report took the gradient (ZeRO stage 2: Overlap.keep):
            # the parameter gets none from Chainer, which then holds the
            # array no longer.
            gy = None
        return tuple(gy if i == 0 else None for i in indexes)


def _anchor(args):
    """The highest-ranked Variable among a link call's arguments."""
    best = None
    for a in list(args.args) + list(args.kwargs.values()):
        if isinstance(a, chainer.Variable) and (best is None
                                                or a.rank > best.rank):
            best = a
    return best


class _Wrapper(chainer.LinkHook):
    """Swaps each link's own initialised parameters for ``_Ready`` outputs
    during its forward."""

    name = 'mnopt_overlap'

    def __init__(self, own, on_wrap, on_ready):
        self._own = own          # id(link) -> [(attribute, full name)]
        self._on_wrap, self._on_ready = on_wrap, on_ready
        self._swapped = []       # (link, attribute, parameter), a stack

    def forward_preprocess(self, args):
        link = args.link
        own = self._own.get(id(link))
        self._swapped.append(None)   # marks this call's start
        if not own:
            return
        anchor = _anchor(args)
        for attr, name in own:
            param = getattr(link, attr)
            if param.array is None:   # initialised by this very forward
                continue
            inputs = (param,) if anchor is None else (param, anchor)
            wrapped, = _Ready(self._on_ready, name).apply(inputs)
            self._on_wrap(name)
            self._swapped.append((link, attr, param))
            vars(link)[attr] = wrapped

    def forward_postprocess(self, args):
        while True:
            entry = self._swapped.pop()
            if entry is None:
                return
            link, attr, param = entry
            vars(link)[attr] = param

    def restore_all(self):
        """After a forward pass that raised: put every parameter back."""
        while self._swapped:
            entry = self._swapped.pop()
            if entry is not None:
                link, attr, param = entry
                vars(link)[attr] = param


class Overlap(object):
    """One optimizer's overlapped averaging: the plan, and per iteration
    what fired, what was launched, and the handles to wait for.

    Extension points (ZeRO stage 2's ShardedOverlap overrides them, and
    uses the helpers ``params``, ``gradient``, ``launch_remaining`` and
    ``set_plan``): ``reset`` (per-iteration state), ``unplanned`` (a node
    fired during the planning iteration), ``keep`` (a node fired for a
    planned parameter), ``bucket_gradient`` (what a bucket holds of a
    parameter), ``send`` (queue one collective), ``finish``, ``adopt`` and
    ``make_plan``.  ``ready`` counts the buckets down and launches them."""

    def __init__(self, communicator, target, zero_fill):
        self.comm = communicator
        self.target = target
        self.zero_fill = zero_fill
        self.plan = None
        self.unchecked = False   # plan not yet compared: ``check_plan``
        self.iteration = 0   # the update whose gradients are averaged
        #: Buckets of the last iteration, and how many were handed to the
        #: communicator during backward.
        self.stats = {'buckets': 0, 'during_backward': 0}
        #: Gradient accumulation's earlier micro-steps ({name: sum}) and
        #: K, for the update being averaged: ``accumulated``.
        self.sums, self.steps, self.folded = {}, 1, set()
        self.reset()

    def accumulated(self, sums, steps):
        """The next backward is the last of ``steps`` micro-steps whose
        earlier ones summed to ``sums`` ({name: array}, taken out of the
        parameters): each gradient that leaves gets its sum added, and
        the total divided by ``steps`` (``fold``)."""
        self.sums, self.steps, self.folded = sums, steps, set()

    def fold(self, name, grad, final=True):
        """``grad`` (an array this update owns) plus the earlier
        micro-steps' sum of ``name``, over K, in place; ``final``: the
        sum is used up (a copy that may yet be dropped is not final).
        ``grad`` alone without accumulation."""
        if self.steps == 1:
            return grad
        if name not in self.folded:
            earlier = self.sums.get(name)
            if earlier is not None:
                grad += earlier
            if final:
                self.folded.add(name)
        grad /= grad.dtype.type(self.steps)
        return grad

    def reset(self):
        """The state of one iteration (before its forward pass)."""
        self.wraps = collections.OrderedDict()   # name -> times wrapped
        self.early = {}      # name -> (gradient received, its copy)
        self.handles = []
        self.rest = []       # (name, gradient) no bucket holds
        self.next_bucket = 0
        self.remaining = None if self.plan is None else \
            [len(b) for b in self.plan]

    def params(self):
        """{name: parameter} of the target."""
        return dict(self.target.namedparams())

    def _own_params(self):
        """id(link) -> [(attribute, full name)] of each link's own
        parameters (a name's last component is the attribute)."""
        own = {}
        for prefix, link in self.target.namedlinks():
            base = '' if prefix == '/' else prefix
            for name, _ in link.namedparams():
                if name.count('/') == 1:
                    own.setdefault(id(link), []).append(
                        (name[1:], base + name))
        return own

    # ------------------------------------------------------------ backward

    def forward_backward(self, lossfun, args, kwds, loss_scale, iteration):
        """The forward pass with parameters wrapped, then backward, which
        hands buckets to the communicator as they become final.  Every
        averaging until ``finish`` is of ``iteration`` (the optimizer's
        update count), however many buckets it takes."""
        self.reset()
        self.iteration = iteration
        self.bucket_of = {} if self.plan is None else {
            n: b for b, names in enumerate(self.plan) for n in names}
        hook = _Wrapper(self._own_params(), self._wrapped, self.ready)
        tl = getattr(self.comm, 'timeline', timelines.NULL)
        try:
            with tl.span('forward', 'compute'), hook:
                loss = lossfun(*args, **kwds)
        finally:
            hook.restore_all()
        self.target.cleargrads()
        with tl.span('backward', 'compute'):
            loss.backward(loss_scale=loss_scale)
        self.stats['during_backward'] = self.next_bucket

    def _wrapped(self, name):
        self.wraps[name] = self.wraps.get(name, 0) + 1

    def ready(self, name, grad):
        """A node's report: ``grad`` is the gradient of parameter ``name``
        from its link's call.  Returns False if ``keep`` took it (the
        parameter gets none from Chainer)."""
        if self.wraps.get(name) != 1:
            return None
        if self.plan is None:
            return self.unplanned(name, grad)
        if name not in self.bucket_of:
            return None
        taken = self.keep(name, grad)
        b = self.bucket_of[name]
        self.remaining[b] -= 1
        while (self.next_bucket < len(self.plan)
               and self.remaining[self.next_bucket] == 0):
            self.launch(self.next_bucket, {})
        return taken

    def unplanned(self, name, grad):
        """A node fired during the planning iteration (no plan yet):
        nothing to do here."""
        return None

    def keep(self, name, grad):
        """Keep the final gradient of planned parameter ``name`` for its
        bucket; False to take it from Chainer (the parameter then gets
        none)."""
        # A copy is averaged: Chainer still holds the gradient it passed
        # (and would add another use's to it, if any: the parameter is
        # then averaged with the rest, its sum folded in again there).
        self.early[name] = (grad, self.fold(name, grad.copy(), final=False))
        return None

    def launch(self, b, params):
        """Hand bucket ``b`` to the communicator (``params``: {name:
        parameter}, needed for names no node fired for)."""
        named = []
        for name in self.plan[b]:
            grad = self.bucket_gradient(name, params)
            if grad is not None:
                named.append((name, grad))
        self.handles.append(self.send(named))
        self.next_bucket += 1

    def bucket_gradient(self, name, params):
        """What a bucket holds of parameter ``name``: the copy its node
        kept, else its gradient (zeros if none, with zero_fill)."""
        if name in self.early:
            return self.early[name][1]
        return self.summed_gradient(name, params[name])

    def summed_gradient(self, name, param):
        """``gradient``, with the earlier micro-steps' sum folded in (a
        parameter without a gradient of its own gets the sum's mean)."""
        grad = self.gradient(param)
        if grad is None and name in self.sums and name not in self.folded:
            # Used in earlier micro-steps only (and no zero_fill).
            grad = param.grad = self.sums[name]
            self.folded.add(name)
            grad /= grad.dtype.type(self.steps)
            return grad
        return grad if grad is None else self.fold(name, grad)

    def send(self, named):
        """Queue one averaging of this iteration's gradients; its handle."""
        return self.comm.mean_grads_async(named, queue=True,
                                          iteration=self.iteration)

    def gradient(self, param):
        """``param``'s gradient (zeros where it has none, with
        zero_fill: then set as its gradient)."""
        if param.grad is None and self.zero_fill and param.array is not None:
            xp = chainer.backend.get_array_module(param.array)
            with chainer.using_device(param.device):
                param.grad = xp.zeros_like(param.array)
        return param.grad

    # ------------------------------------------------------------ update

    def launch_remaining(self, params):
        """Launch the planned buckets backward did not; returns the names
        the plan covers (none without a plan)."""
        if self.plan is None:
            return set()
        while self.next_bucket < len(self.plan):
            self.launch(self.next_bucket, params)
        return {n for names in self.plan for n in names}

    def finish(self):
        """Hand the communicator the buckets backward did not (every rank
        the same averagings, in the same order), then return the handles.
        What no bucket holds waits in ``rest`` for ``send_rest``, which
        every rank calls alike once the ranks have said whether any holds
        some (the optimizer's step exchange): usually none does, and an
        empty set is never averaged.  Gradients that a node vouched for
        must then be adopted (``adopt``) once the handles are done."""
        params = self.params()
        covered = self.launch_remaining(params)
        self.stats['buckets'] = 0 if self.plan is None else len(self.plan)
        # Vouched for: the gradient a node received is the final one.
        self.clean = {n for n, (grad, _) in self.early.items()
                      if params[n].grad is grad}
        rest = [n for n in sorted(params) if params[n].array is not None
                and (n not in covered or (n in self.early
                                          and n not in self.clean))]
        self.rest = [(n, g) for n, g in (
            (n, self.summed_gradient(n, params[n])) for n in rest)
            if g is not None]
        self.accumulated({}, 1)
        return self.handles

    def send_rest(self, anyone_has_rest):
        """Queue the averaging of ``rest`` if ``anyone_has_rest`` (the
        same on every rank: a rank without one then sends its empty set,
        which the layout check refuses on every rank, as it should);
        returns the handles."""
        if anyone_has_rest:
            self.handles.append(self.send(self.rest))
        self.rest = []
        return self.handles

    def adopt(self):
        """The averaged copies become the parameters' gradients."""
        params = self.params()
        for name in self.clean:
            params[name].grad = self.early[name][1]
        self.early = {}

    def make_plan(self, alone=False):
        """Buckets in backward order from this iteration's forward pass,
        checked to be the same on every rank, or ``alone`` not yet (a comm
        hook's keys are the buckets' from its first update on)."""
        params = self.params()
        order = [n for n, k in self.wraps.items()
                 if k == 1 and params[n].grad is not None]
        self.set_plan([(n, params[n].grad.nbytes) for n in order], alone)

    def set_plan(self, order, alone=False):
        """Buckets of ``[(name, nbytes), ...]`` (forward order), checked
        to be the same on every rank unless ``alone``."""
        # A bucket closes once it holds bucket_bytes (as DDP's do): a small
        # gradient next to a big one rides with it instead of paying a
        # collective's latency alone.
        plan, size = [], None
        for name, nbytes in reversed(order):
            if size is None or size >= self.comm.bucket_bytes:
                plan.append([])
                size = 0
            plan[-1].append(name)
            size += nbytes
        self.plan, self.unchecked = plan, alone
        self.remaining = [len(b) for b in plan]
        if not alone:
            self.check_plan()

    def check_plan(self):
        """The plan, once the same on every rank (else a RuntimeError on
        every rank).  Collective."""
        plan, self.unchecked = self.plan, False
        plans = self.comm.everyone(plan, 'the overlapped buckets')
        if any(p != plan for p in plans):
            self.plan = None
            bad = [r for r, p in enumerate(plans) if p != plans[0]]
            raise RuntimeError(
                'overlap: the forward passes differ between ranks (the '
                'order in which links use their parameters): rank 0 and '
                'ranks %s would average different buckets' % bad)

    def forget_plan(self):
        """No plan: the next iteration plans again."""
        self.plan, self.unchecked = None, False
