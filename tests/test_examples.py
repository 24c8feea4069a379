"""The ImageNet and digits examples, run as whole mpiexec jobs."""

import json
import os
import re
import shutil

import numpy

import pytest

from conftest import (REPO, build_embedded_set, run_mpi,
                      snapshot_models_equal, snapshot_plots_equal)
from damaged_npz import damage_stored_member

pytestmark = pytest.mark.spawn
pytest.importorskip('chainer', reason='the examples need Chainer')
pytest.importorskip('PIL', reason="the examples need mnopt[examples]")
TRAIN = os.path.join(REPO, 'examples', 'imagenet', 'train_imagenet.py')
DIGITS = os.path.join(REPO, 'examples', 'digits', 'train_digits.py')


#: The embedded set, smaller: the jobs run a few iterations (at most 3
#: ranks x 4 images), and each validates on the whole validation set.
IMAGES_PER_CLASS, VAL_PER_CLASS = 10, 2


@pytest.fixture(scope='module')
def data_cache(tmp_path_factory):
    return build_embedded_set(str(tmp_path_factory.mktemp('embedded')),
                              IMAGES_PER_CLASS, VAL_PER_CLASS)


def shown(text):
    """The example's output as a terminal shows it: without the progress
    bar's cursor movements."""
    return re.sub(r'\x1b\[\d*[A-Za-z]', '', text)


def unwrapped(text):
    """The example's output with its wrapped lines (the header's and the
    summary's, continued under their text) joined again."""
    return re.sub(r'\n {11}(?=\S)', ' ', shown(text))


def within_80_columns(text):
    """The lines of ``text`` longer than 80 columns, but a line of one
    path alone (a path is never broken, so it can be copied)."""
    return [line for line in text.splitlines()
            if len(line) > 80 and len(line.split()) > 1]


def train(n, out, cache, *flags, timeout=240, plot=False):
    """The example on ``n`` ranks; without its plots unless ``plot``
    (matplotlib took half of a short job's time)."""
    code = 'import runpy, sys\nrunpy.run_path(%r, run_name="__main__")\n' \
        % TRAIN
    return run_mpi(n, code, timeout=timeout, args=[
        '--out', str(out), '--data-cache', cache, '--batchsize', '4',
        '--val-batchsize', '8', '--cpu'] + list(flags) + (
            [] if plot else ['--noplot']))



# Every flag once, several to a job (each job costs seconds of start-up).
@pytest.mark.parametrize('flags', [
    ['--communicator', 'flat', '--arch', 'nin'],   # ImageNet's default
    ['--communicator', 'hierarchical', '--allreduce-grad-dtype', 'float16',
     '--shard-state'],
    ['--communicator', 'naive', '--double-buffering',
     '--accumulation-steps', '2'],
    ['--communicator', 'flat', '--overlap', '--shard-state', '--loaderjob',
     '2'],   # ZeRO stage 2
    ['--communicator', 'flat', '--mnbn'],   # smallcnn's batch norms
    ['--communicator', 'flat', '--compression', 'auto'],
], ids=['flat-nin', 'hierarchical-fp16', 'naive-double-buffering-accumulation',
        'overlap-stage2-loader-processes', 'mnbn', 'compression-auto'])
def test_a_few_iterations(tmp_path, data_cache, flags):
    proc = train(2, tmp_path, data_cache, '--iteration', '4', *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The header and the summary within 80 columns, table included.
    assert not within_80_columns(shown(proc.stdout)), shown(proc.stdout)
    proc.stdout = unwrapped(proc.stdout)
    assert 'mnopt ImageNet example: 2 ranks' in proc.stdout
    assert proc.stdout.count('mnopt ImageNet example') == 1  # rank 0 only
    assert (tmp_path / 'log').exists()
    assert (tmp_path / 'snapshot_iter_4.npz').exists()
    if '--mnbn' in flags:
        assert ', multi-node batch normalization' in proc.stdout
    assert (', sharded optimizer state' in proc.stdout) == (
        '--shard-state' in flags)
    # The summary at the end, once.
    name = flags[1]
    wire = flags[3] if '--allreduce-grad-dtype' in flags else 'float32'
    assert proc.stdout.count('== mnopt: 2 ranks, communicator %s, wire %s'
                             % (name, wire)) == 1, proc.stdout[-2000:]
    assert 'training   4 iterations this run in' in proc.stdout
    # The closing line names the modes the header names, in its words.
    header = re.search(r'^mnopt ImageNet example: (.*)$', proc.stdout,
                       re.M).group(1)
    closing = re.search(r'^== mnopt: (.*)$', proc.stdout, re.M).group(1)
    assert header.startswith(closing + ', '), (header, closing)
    for flag, mode in (('--double-buffering', 'double buffering'),
                       ('--overlap', 'overlap'),
                       ('--shard-state', 'sharded optimizer state'),
                       ('--mnbn', 'multi-node batch normalization'),
                       ('--accumulation-steps', 'an update every 2 '
                        'iterations'),
                       ('--compression', 'auto compression rank 1')):
        assert (', ' + mode in closing) == (flag in flags), closing
    if '--compression' in flags:
        # What 'auto' chose, or that it has not yet: it times each
        # gradient set both ways first.
        assert re.search(r'^compression .* against .* plain \(\d+\.\d%\); '
                         r'auto (chose PowerSGD for \d+ of \d+|had not '
                         r'chosen yet)', proc.stdout, re.M), proc.stdout
    # The table in units and words (the log keeps the raw values).
    rows = [line.split() for line in proc.stdout.splitlines()
            if line.split()[:1] == ['0']]
    assert rows and all(r[-2] in ('none', 'r0', 'r1') for r in rows), rows
    # The bus bandwidth in units (absent before the first averaging ends:
    # double-buffered with an update every 2 iterations, the 4 iterations'
    # one averaging starts at the last update and may still be running in
    # the background at the last report).
    if not {'--double-buffering', '--accumulation-steps'} <= set(flags):
        assert any(r[-3].endswith('B/s') for r in rows), \
            [' '.join(r) for r in rows]
    assert 'e+' not in proc.stdout and 'e-' not in proc.stdout, proc.stdout
    # Each step's communication in the log (CommunicationReport), with who
    # the ranks waited for.
    with open(str(tmp_path / 'log')) as f:
        log = json.load(f)
    assert log and all('comm/exposed' in e and 'comm/hidden' in e
                       for e in log), log
    assert all(e['comm/straggler'] in (-1, 0, 1) for e in log), log
    assert '% of step time blocked in averaging' in proc.stdout
    hides = {'--double-buffering': 'double buffering hid ',
             '--overlap': 'overlap hid '}
    for flag, line in hides.items():
        assert (line in proc.stdout) == (flag in flags), proc.stdout[-2000:]
    assert summary_snapshot(proc.stdout) == str(tmp_path /
                                                'snapshot_iter_4.npz')


def summary_snapshot(stdout):
    """The snapshot the summary names (the path may have a line of its
    own)."""
    return re.search(r'^snapshot\s+(\S+) \(--resume auto continues from '
                     r'it\)', unwrapped(stdout), re.M).group(1)


def test_the_plots_say_their_units():
    pytest.importorskip('matplotlib')
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from conftest import imagenet_example_module
    plots = imagenet_example_module('plots')
    points = {key: [[1, 0.5], [2, 0.25]] for _, keys in plots.FIGURES
              for key in keys}
    for file_name, keys in plots.FIGURES:
        figure = plots.figure_of(plt, file_name, keys, points)
        try:
            assert figure.axes[0].get_xlabel() == 'epoch'
            label = figure.axes[0].get_ylabel()
            assert label, file_name
            if file_name == 'communication.png':
                # Observed in seconds, drawn in milliseconds.
                assert label == 'milliseconds per step'
                assert list(figure.axes[0].lines[0].get_ydata()) == \
                    [500.0, 250.0]
        finally:
            plt.close(figure)


@pytest.mark.parametrize('flags', [
    [], ['--double-buffering'],
    # Local steps: each rank's file holds its own replica (parameters,
    # inner state), which differ between syncs.  The snapshot at 3 is
    # mid-H at H=4, right after a sync at H=2 (update 1 broadcasts), and
    # with a fragment's averaging in flight at 2 fragments and a delay.
    ['--local-steps', '4'], ['--local-steps', '2'],
    ['--local-steps', '4', '--fragments', '2', '--fragment-sync-delay', '1'],
], ids=['synchronous', 'double-buffering', 'local-steps-mid-h',
        'local-steps-at-sync', 'local-steps-in-flight'])
def test_resume_reproduces_an_uninterrupted_run(tmp_path, data_cache, flags):
    # A constant learning rate: the embedded set's default decays it to 0
    # over the run's length, which the shorter first part is not.
    db = ['--lr-schedule', 'constant'] + flags
    plot_first = '--double-buffering' in flags
    whole, part = tmp_path / 'whole', tmp_path / 'part'
    assert train(2, whole, data_cache, '--iteration', '6',
                 '--snapshot-interval', '3', '--keep-snapshots', '5',
                 *db).returncode == 0
    # Plots drawn in one part only: a run without them (--noplot) resumes
    # with them, and the other way round; either way the plots' state is
    # the uninterrupted run's.
    assert train(2, part, data_cache, '--iteration', '3',
                 '--snapshot-interval', '3', *db,
                 plot=plot_first).returncode == 0
    proc = train(2, part, data_cache, '--iteration', '6',
                 '--snapshot-interval', '3', '--resume',
                 str(part / 'snapshot_iter_3.npz'), *db,
                 plot=not plot_first)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'resumed from' in proc.stdout
    assert 'UserWarning' not in proc.stderr, proc.stderr[-3000:]
    snapshot_models_equal(whole / 'snapshot_iter_6.npz',
                          part / 'snapshot_iter_6.npz')
    snapshot_plots_equal(whole / 'snapshot_iter_6.npz',
                         part / 'snapshot_iter_6.npz')
    if '--local-steps' in flags:   # every rank's replica, and the rest
        replicas_equal(whole, part, 6)
    # Validated with each rank's own batch normalization statistics (rank
    # 1's come back from its rank file, not rank 0's from the shared one).
    validated = [json.load(open(str(out / 'log')))[-1]['validation/main/loss']
                 for out in (whole, part)]
    assert validated[0] == validated[1], validated


def replicas_equal(whole, part, iteration, ranks=2):
    """Assert that snapshot ``iteration`` of runs ``whole`` and ``part``
    holds the same multi-node optimizer state in the shared file (the
    local steps' synced parameters, outer state, rank 0's inner state),
    and the same model and optimizer in every rank's file, bit for bit."""
    name = 'snapshot_iter_%d' % iteration
    files = [(name + '.npz', 'updater/optimizer:main/')] + [
        ('%s.rank%d.npz' % (name, r), 'replica/') for r in range(ranks)]
    for file_name, prefix in files:
        with numpy.load(str(whole / file_name)) as a, \
                numpy.load(str(part / file_name)) as b:
            keys = [k for k in a.files if k.startswith(prefix)]
            assert keys and sorted(keys) == sorted(
                k for k in b.files if k.startswith(prefix)), file_name
            differ = [k for k in keys if a[k].tobytes() != b[k].tobytes()]
            assert differ == [], (file_name, differ)


@pytest.mark.parametrize('compression', [
    ['--compression', 'powersgd', '--powersgd-rank', '2'],
    ['--compression', 'sign']], ids=['powersgd', 'sign'])
def test_resume_with_compression_reproduces_an_uninterrupted_run(
        tmp_path, data_cache, compression):
    # The residuals differ from rank to rank: the shared file (rank 0's)
    # holds rank 0's alone, so the other ranks' come from their own rank
    # files.  Compressed from the second iteration, so the resume at 3
    # starts with residuals on every rank.
    flags = ['--lr-schedule', 'constant', '--warmup-steps', '1'] + \
        compression
    whole, part = tmp_path / 'whole', tmp_path / 'part'
    assert train(2, whole, data_cache, '--iteration', '6',
                 '--snapshot-interval', '3', '--keep-snapshots', '5',
                 *flags).returncode == 0
    assert train(2, part, data_cache, '--iteration', '3',
                 '--snapshot-interval', '3', *flags).returncode == 0
    proc = train(2, part, data_cache, '--iteration', '6',
                 '--snapshot-interval', '3', '--resume',
                 str(part / 'snapshot_iter_3.npz'), *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'resumed from' in proc.stdout
    snapshot_models_equal(whole / 'snapshot_iter_6.npz',
                          part / 'snapshot_iter_6.npz')
    # The shared file (rank 0's residuals) loads before the rank's own
    # file replaces them: no warning that they were dropped (it waits for
    # the first averaging).
    assert 'residuals restart at zero' not in proc.stderr


def optimizer_shares(out, iteration):
    """{rank: {key: array}}: each rank file's share of a sharded optimizer
    (its ``optimizer/`` entries), and the names of every parameter."""
    shares, names = {}, None
    for r in range(4):
        path = out / ('snapshot_iter_%d.rank%d.npz' % (iteration, r))
        if not path.exists():
            continue
        with numpy.load(str(path)) as f:
            shares[r] = {k: f[k] for k in f.files
                         if k.startswith('optimizer/')}
        names = [str(n) for n in shares[r]['optimizer/mnopt_shard/names']]
        assert int(shares[r]['optimizer/mnopt_shard/rank']) == r
    return shares, names


def check_one_owner_each(out, iteration, n):
    """Snapshot ``iteration`` of an ``n``-rank sharded run: every rank
    file holds its share (MomentumSGD's v of the parameters it owns), and
    every parameter's state is in exactly one of them."""
    shares, names = optimizer_shares(out, iteration)
    assert sorted(shares) == list(range(n))
    held = [k[len('optimizer/'):-len('/v')] for share in shares.values()
            for k in share if k.endswith('/v')]
    assert sorted(held) == sorted(n.lstrip('/') for n in names)
    assert all(any(k.endswith('/v') for k in share)
               for share in shares.values())
    return shares


def test_sharded_state_resumes_bit_for_bit_and_re_shards(tmp_path,
                                                         data_cache):
    """--shard-state: each rank file holds the rank's share of the
    optimizer state; resuming from the snapshot at iteration 3 ends with
    the uninterrupted run's model and shares, bit for bit; resuming it on
    3 ranks re-shards the state and trains on."""
    flags = ['--shard-state', '--lr-schedule', 'constant',
             '--snapshot-interval', '3', '--keep-snapshots', '5']
    whole, part, resized = (tmp_path / d for d in ('whole', 'part',
                                                   'resized'))
    proc = train(2, whole, data_cache, '--iteration', '6', *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = check_one_owner_each(whole, 6, 2)
    for out in part, resized:    # as if the run had stopped at 3
        out.mkdir()
        for name in os.listdir(str(whole)):
            if name.startswith('snapshot_iter_3.'):
                shutil.copy(str(whole / name), str(out / name))
    proc = train(2, part, data_cache, '--iteration', '6', '--resume',
                 'auto', *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'resumed from %s at iteration 3' % (part / 'snapshot_iter_3.npz') \
        in proc.stdout, proc.stdout[-3000:]
    snapshot_models_equal(whole / 'snapshot_iter_6.npz',
                          part / 'snapshot_iter_6.npz')
    got, _ = optimizer_shares(part, 6)
    for r in want:
        assert sorted(got[r]) == sorted(want[r])
        for k in want[r]:
            numpy.testing.assert_array_equal(got[r][k], want[r][k],
                                             err_msg=k)

    proc = train(3, resized, data_cache, '--iteration', '4', '--resume',
                 'auto', *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'at iteration 3 (data split anew for 3 ranks) (optimizer state ' \
        're-sharded from 2 to 3 ranks)' in proc.stdout, proc.stdout[-3000:]
    check_one_owner_each(resized, 4, 3)


@pytest.mark.parametrize('flags', [['--double-buffering'],
                                   ['--communicator', 'reduction_server']],
                         ids=['double-buffering', 'reduction-server'])
def test_shard_state_where_it_cannot_is_an_error_on_every_rank(
        tmp_path, data_cache, flags):
    proc = train(2, tmp_path, data_cache, '--shard-state', '--iteration',
                 '1', *flags, timeout=120)
    assert proc.returncode != 0
    # Every rank says why, before any training.
    assert proc.stderr.count('train_imagenet.py: ') == 2, proc.stderr[-3000:]
    assert 'mnopt ImageNet example' not in proc.stdout


def test_a_bad_accumulation_is_an_error_on_every_rank(tmp_path, data_cache):
    proc = train(2, tmp_path, data_cache, '--accumulation-steps', '0',
                 '--iteration', '1', timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count('train_imagenet.py: accumulation_steps must '
                             'be a whole number') == 2, proc.stderr[-3000:]
    assert 'mnopt ImageNet example' not in proc.stdout


def test_resume_on_another_number_of_ranks(tmp_path, data_cache):
    assert train(1, tmp_path, data_cache, '--iteration', '2',
                 '--snapshot-interval', '2').returncode == 0
    proc = train(3, tmp_path, data_cache, '--iteration', '4', '--resume',
                 str(tmp_path / 'snapshot_iter_2.npz'))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'data split anew for 3 ranks' in proc.stdout
    # The epoch goes on: the examples it has not read, split among the 3
    # ranks (rank 0's file records which), and the plots' sums with it:
    # iterations 1 to 4.
    assert re.search(r'snapshot_iter_2.npz: updater/iterator:main: epoch 0 '
                     r'resumed with \d+ of its examples not read yet',
                     proc.stdout), proc.stdout[-3000:]
    assert (tmp_path / 'snapshot_iter_4.npz').exists()
    with numpy.load(str(tmp_path / 'snapshot_iter_4.npz')) as f:
        sums = json.loads(str(f['extensions/epoch_plots/sums']))
    assert sums['main/loss'][1] == 4, sums
    # The unsharded snapshot split into shares (its lazily sized layers
    # have data only once the model is loaded, after the optimizer).
    proc = train(2, tmp_path, data_cache, '--iteration', '3', '--resume',
                 str(tmp_path / 'snapshot_iter_2.npz'), '--shard-state')
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'data split anew for 2 ranks' in proc.stdout
    assert 're-sharded' not in proc.stdout
    check_one_owner_each(tmp_path, 3, 2)


@pytest.mark.parametrize('damage', ['missing', 'corrupt'])
def test_bad_snapshot_is_a_clear_error(tmp_path, data_cache, damage):
    snap = tmp_path / 'snapshot_iter_9.npz'
    if damage == 'corrupt':
        snap.write_bytes(b'PK\x03\x04 this is not a snapshot')
    proc = train(2, tmp_path, data_cache, '--iteration', '2', '--resume',
                 str(snap), timeout=120)
    assert proc.returncode != 0
    # One message, from rank 0 (every rank exits non-zero), no traceback.
    assert proc.stderr.count('cannot resume from %s' % snap) == 1, \
        proc.stderr[-3000:]
    assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]
    if damage == 'missing':   # the reason is known: no guessing
        assert 'cannot resume from %s: there is no such file' % snap \
            in proc.stderr, proc.stderr[-3000:]
    else:
        assert '(missing, corrupt or not a snapshot of this model)' \
            in proc.stderr, proc.stderr[-3000:]


def test_a_sharded_snapshot_resumed_unsharded_says_so_once(tmp_path,
                                                           data_cache):
    assert train(2, tmp_path, data_cache, '--iteration', '2',
                 '--shard-state').returncode == 0
    snap = tmp_path / 'snapshot_iter_2.npz'
    proc = train(2, tmp_path, data_cache, '--iteration', '3', '--resume',
                 str(snap), timeout=120)
    assert proc.returncode != 0
    said = ('train_imagenet.py: cannot resume from %s: its optimizer state '
            'is sharded over 2 ranks (written with --shard-state): resume '
            'with --shard-state' % snap)
    assert said in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count('cannot resume') == 1, proc.stderr[-3000:]
    assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize('resumed_with, said', [
    ([], 'it was written with --local-steps 4 --fragments 2 '
     '--fragment-sync-delay 1, and between syncs each rank holds its own '
     'parameters and inner optimizer state, which a run without '
     '--local-steps cannot continue: resume it with those flags (on any '
     'number of ranks)'),
    (['--local-steps', '8', '--fragments', '2', '--fragment-sync-delay',
      '1'], 'it was written with --local-steps 4; this run has '
     "--local-steps 8: resume it with the snapshot's"),
], ids=['without-local-steps', 'other-local-steps'])
def test_a_local_steps_snapshot_resumed_otherwise_names_its_flags(
        tmp_path, data_cache, resumed_with, said):
    """Refused before anything loads, on every rank, naming the example's
    flags the snapshot was written with (a known reason: no guess that the
    file is damaged)."""
    assert train(2, tmp_path, data_cache, '--iteration', '3',
                 '--local-steps', '4', '--fragments', '2',
                 '--fragment-sync-delay', '1').returncode == 0
    snap = tmp_path / 'snapshot_iter_3.npz'
    proc = train(2, tmp_path, data_cache, '--iteration', '4', '--resume',
                 str(snap), *resumed_with, timeout=120)
    assert proc.returncode != 0
    assert 'train_imagenet.py: cannot resume from %s: %s' % (snap, said) \
        in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count('cannot resume') == 1, proc.stderr[-3000:]
    assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]


@pytest.fixture(scope='module')
def two_snapshots(tmp_path_factory, data_cache):
    """An output directory with snapshots 2 and 4 of a 2-rank run: copy it
    (``copy_of``) before changing it."""
    out = tmp_path_factory.mktemp('two-snapshots')
    proc = train(2, out, data_cache, '--iteration', '4',
                 '--snapshot-interval', '2', '--keep-snapshots', '5',
                 plot=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def copy_of(snapshots, tmp_path):
    out = tmp_path / 'out'
    shutil.copytree(str(snapshots), str(out))
    return out


def snapshot_names(out):
    return sorted(n for n in os.listdir(str(out))
                  if n.startswith('snapshot_iter_'))


def test_resume_auto_skips_a_damaged_snapshot(tmp_path, data_cache,
                                              two_snapshots):
    out = copy_of(two_snapshots, tmp_path)
    damage_stored_member(str(out / 'snapshot_iter_4.npz'))   # 4 KiB
    # Plots on both sides: their data comes back with the snapshot.
    proc = train(2, out, data_cache, '--iteration', '6',
                 '--snapshot-interval', '2', '--resume', 'auto', plot=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'resumed from %s at iteration 2' % (out / 'snapshot_iter_2.npz') \
        in proc.stdout, proc.stdout[-3000:]
    assert 'skipping snapshot snapshot_iter_4.npz, which not every rank ' \
        'can load: rank 0: snapshot_iter_4.npz is damaged (member ' \
        in proc.stderr, proc.stderr[-3000:]
    assert 'fails its CRC check)' in proc.stderr
    assert (out / 'snapshot_iter_6.npz').exists()


def test_a_run_on_other_ranks_in_the_same_out_keeps_to_itself(tmp_path,
                                                             data_cache):
    # make run, then make run NP=3 in the same --out: the 2-rank run's
    # snapshot is at a later iteration (10) than any of the 3-rank run's.
    proc = train(2, tmp_path, data_cache, '--iteration', '10',
                 '--snapshot-interval', '10', '--keep-snapshots', '5')
    assert proc.returncode == 0, proc.stderr[-3000:]
    # An epoch on 3 ranks: 27 images each, 4 a step: 7 iterations, the
    # last no multiple of the log's interval (5).
    proc = train(3, tmp_path, data_cache, '--epoch', '1',
                 '--keep-snapshots', '5')
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary_snapshot(proc.stdout) == str(tmp_path /
                                                'snapshot_iter_7.npz')
    with open(str(tmp_path / 'log')) as f:
        log = json.load(f)
    assert [e['iteration'] for e in log] == [5, 7], log
    assert 'validation/main/accuracy' in log[-1], log
    summary = unwrapped(proc.stdout)
    assert re.search(r'^validation accuracy .* \(iteration 7, epoch 1;',
                     summary, re.M), summary
    assert re.search(r'^ +1 +7 ', summary, re.M), summary  # the table's
    # --resume auto continues the run that wrote last, not the other's
    # later iteration; its summary counts this run's iterations alone.
    proc = train(3, tmp_path, data_cache, '--iteration', '9', '--resume',
                 'auto')
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'resumed from %s at iteration 7' % (
        tmp_path / 'snapshot_iter_7.npz') in proc.stdout, proc.stdout
    summary = unwrapped(proc.stdout)
    assert re.search(r'^training   2 iterations this run \(7 before the '
                     r'resume\) in [\d.]+ s: \d+ images/s', summary,
                     re.M), summary
    assert 'nan' not in summary
    assert summary_snapshot(proc.stdout) == str(tmp_path /
                                                'snapshot_iter_9.npz')


def test_resume_auto_refuses_another_configurations_snapshot(
        tmp_path, data_cache, two_snapshots):
    out = copy_of(two_snapshots, tmp_path)
    proc = train(2, out, data_cache, '--iteration', '6', '--arch', 'nin',
                 '--resume', 'auto', timeout=120)
    assert proc.returncode != 0
    said = ('train_imagenet.py: --resume auto: the newest snapshot in %s is '
            'snapshot_iter_4.npz, and it is of a run with --arch smallcnn '
            '--insize 48 --n-classes 8; this run has --arch nin --insize 48 '
            '--n-classes 8. Run with its settings to continue it, give '
            'another --out to start afresh' % out)
    # Said once (rank 0); every rank exits non-zero.
    assert proc.stderr.count(said) == 1, proc.stderr[-3000:]
    assert 'resumed from' not in proc.stdout
    assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]


def set_config(path, **config):
    """Rewrite the configuration the shared file ``path`` records, as if
    another run had written it (its time of writing kept)."""
    written = os.stat(str(path))
    with numpy.load(str(path)) as f:
        members = {k: f[k] for k in f.files}
    key = 'extensions/rank_snapshot/config'
    members[key] = numpy.asarray(json.dumps(
        dict(json.loads(str(members[key])), **config), sort_keys=True))
    with open(str(path), 'wb') as f:
        numpy.savez(f, **members)
    os.utime(str(path), ns=(written.st_atime_ns, written.st_mtime_ns))


def test_resume_auto_never_falls_back_to_another_configuration(
        tmp_path, data_cache, two_snapshots):
    # The newest snapshot damaged, the one before it another run's, of
    # another model: skipped, said, and the run starts afresh.
    out = copy_of(two_snapshots, tmp_path)
    set_config(out / 'snapshot_iter_2.npz', arch='nin')
    damage_stored_member(str(out / 'snapshot_iter_4.npz'))
    proc = train(2, out, data_cache, '--iteration', '2', '--resume', 'auto',
                 timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'resumed from' not in proc.stdout, proc.stdout[-3000:]
    assert 'training   2 iterations this run in' in unwrapped(proc.stdout)
    assert 'skipping snapshot snapshot_iter_2.npz, which not every rank ' \
        'can load: rank 0: it is of a run with --arch nin --insize 48 ' \
        '--n-classes 8; this run has --arch smallcnn' in proc.stderr, \
        proc.stderr[-3000:]
    assert 'skipping snapshot snapshot_iter_4.npz' in proc.stderr


def test_a_resumed_powersgd_runs_summary(tmp_path, data_cache):
    flags = ['--compression', 'powersgd', '--powersgd-rank', '2',
             '--double-buffering', '--snapshot-interval', '3']
    proc = train(2, tmp_path, data_cache, '--iteration', '3', *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = train(2, tmp_path, data_cache, '--iteration', '5', '--resume',
                 'auto', *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)   # the summary, for whoever reads the test's output
    summary = unwrapped(proc.stdout)
    assert re.search(r'^== mnopt: 2 ranks, communicator \w+, wire float32, '
                     r'powersgd compression rank 2, double buffering$',
                     summary, re.M), summary
    assert re.search(r'^training   2 iterations this run \(3 before the '
                     r'resume\) in [\d.]+ s: \d+ images/s', summary,
                     re.M), summary
    assert 'nan' not in summary
    # PowerSGD's factors against the plain gradients, per step.
    sent = re.search(r'^compression ([\d.]+) (\w+) a step on the wire '
                     r'against ([\d.]+) (\w+) plain \(([\d.]+)%\)$',
                     summary, re.M)
    assert sent, summary
    assert 0 < float(sent.group(5)) < 100, sent.group(0)


def test_keep_snapshots_counts_and_removes_only_this_configurations(
        tmp_path, data_cache, two_snapshots):
    out = copy_of(two_snapshots, tmp_path)
    set_config(out / 'snapshot_iter_4.npz', arch='nin')   # another run's
    damage_stored_member(str(out / 'snapshot_iter_2.npz'))
    proc = train(2, out, data_cache, '--iteration', '3',
                 '--snapshot-interval', '3', '--keep-snapshots', '1')
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Neither the damaged one nor the other configuration's counted or
    # removed: this run's own is the one kept.
    assert [n for n in snapshot_names(out) if 'rank' not in n] == [
        'snapshot_iter_2.npz', 'snapshot_iter_3.npz', 'snapshot_iter_4.npz']
    assert 'replacing' not in proc.stderr
    # A run that reaches the other configuration's iteration replaces its
    # snapshot, and says so once.
    proc = train(2, out, data_cache, '--iteration', '4',
                 '--snapshot-interval', '2', '--keep-snapshots', '1')
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = ('train_imagenet.py: warning: replacing %s, a snapshot of '
            'another run (it is of a run with --arch nin'
            % (out / 'snapshot_iter_4.npz'))
    assert proc.stderr.count(said) == 1, proc.stderr[-3000:]
    assert proc.stderr.count('replacing') == 1, proc.stderr[-3000:]
    assert [n for n in snapshot_names(out) if 'rank' not in n] == [
        'snapshot_iter_4.npz']


def test_a_powersgd_snapshot_resumed_plain_with_nothing_left(tmp_path,
                                                             data_cache):
    assert train(2, tmp_path, data_cache, '--iteration', '2',
                 '--compression', 'powersgd').returncode == 0
    proc = train(2, tmp_path, data_cache, '--iteration', '2', '--resume',
                 'auto')
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The shared file and the rank's own both hold the state: said once.
    assert proc.stderr.count("the snapshot holds PowerSGD's state") == 1, \
        proc.stderr[-3000:]
    summary = unwrapped(proc.stdout).split('== mnopt:')[1]
    assert re.search(r'^averaging  none: nothing was trained this run$',
                     summary, re.M), summary
    assert '0.0%' not in summary and 'per step' not in summary, summary


def test_the_summary_says_what_auto_chose(monkeypatch):
    from conftest import imagenet_example_module
    monkeypatch.syspath_prepend(os.path.dirname(TRAIN))   # its plots.py
    choices = imagenet_example_module('run_summary').auto_choices
    assert choices(['plain', 'plain'], saved=False) == \
        'auto chose plain for both gradient sets'
    assert choices(['plain', 'plain', 'plain'], saved=True) == \
        'auto chose plain for all 3 gradient sets (the bytes saved are ' \
        "its trial steps', compressed to time them)"
    assert choices(['compressed'], saved=True) == \
        'auto chose PowerSGD for the gradient set'
    assert choices(['compressed', 'plain'], saved=True) == \
        'auto chose PowerSGD for 1 of 2 gradient sets, plain for the rest'
    assert 'had not chosen yet' in choices([], saved=False)


@pytest.mark.parametrize('rank', [0, 1])
def test_resume_with_a_rank_file_missing_is_an_error(tmp_path, data_cache,
                                                     two_snapshots, rank):
    # Same number of ranks, one rank's part gone: never "as if resized".
    out = copy_of(two_snapshots, tmp_path)
    part = out / ('snapshot_iter_4.rank%d.npz' % rank)
    part.unlink()
    proc = train(2, out, data_cache, '--iteration', '6', '--resume',
                 str(out / 'snapshot_iter_4.npz'), timeout=120)
    assert proc.returncode != 0
    assert 'cannot resume from' in proc.stderr, proc.stderr[-3000:]
    assert 'rank %d: written by 2 ranks, as many as now, but rank %d\'s ' \
        'part' % (rank, rank) in proc.stderr, proc.stderr[-3000:]
    assert 'missing, corrupt' not in proc.stderr   # the reason is known
    assert str(part) in proc.stderr
    assert 'data split anew' not in proc.stdout


def test_rank_0s_part_missing_on_another_number_of_ranks_is_incomplete(
        tmp_path, data_cache, two_snapshots):
    # A node lost at the snapshot step: the shared file of 4 written, rank
    # 0's own part (the epoch's position across ranks) never.  On another
    # number of ranks the snapshot is incomplete, never the epoch started
    # again from its beginning.
    out = copy_of(two_snapshots, tmp_path)
    part = out / 'snapshot_iter_4.rank0.npz'
    part.unlink()
    proc = train(1, out, data_cache, '--iteration', '6', '--resume',
                 str(out / 'snapshot_iter_4.npz'), timeout=120)
    assert proc.returncode != 0
    assert 'cannot resume from %s: rank 0: written by 2 ranks, and on ' \
        "another number rank 0's part, which records where its epoch is, " \
        'is needed: snapshot_iter_4.rank0.npz is missing' % (
            out / 'snapshot_iter_4.npz') in proc.stderr, proc.stderr[-3000:]
    assert 'missing, corrupt' not in proc.stderr   # the reason is known
    proc = train(1, out, data_cache, '--iteration', '6',
                 '--snapshot-interval', '2', '--resume', 'auto')
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'skipping snapshot snapshot_iter_4.npz, which not every rank ' \
        'can load: rank 0: written by 2 ranks' in proc.stderr, \
        proc.stderr[-3000:]
    assert 'resumed from %s at iteration 2' % (out / 'snapshot_iter_2.npz') \
        in proc.stdout, proc.stdout[-3000:]
    assert re.search(r'snapshot_iter_2.npz: updater/iterator:main: epoch 0 '
                     r'resumed with \d+ of its examples not read yet',
                     proc.stdout), proc.stdout[-3000:]


def test_keep_snapshots_never_counts_an_incomplete_snapshot(tmp_path,
                                                             data_cache):
    # A 3-rank sharded run's snapshot 4 lacks rank 2's file (its node lost
    # mid-snapshot): on 2 ranks no snapshot (the shares need every file),
    # so the run resumes from 2.  With --keep-snapshots 1 and its own
    # snapshot 3 in flight, 2 is the one to keep, not 4.
    assert train(3, tmp_path, data_cache, '--iteration', '4',
                 '--snapshot-interval', '2', '--keep-snapshots', '5',
                 '--shard-state').returncode == 0
    (tmp_path / 'snapshot_iter_4.rank2.npz').unlink()
    proc = train(2, tmp_path, data_cache, '--iteration', '3',
                 '--snapshot-interval', '3', '--keep-snapshots', '1',
                 '--shard-state', '--async-snapshots', '--resume', 'auto')
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'resumed from %s at iteration 2' % (
        tmp_path / 'snapshot_iter_2.npz') in proc.stdout, proc.stdout[-3000:]
    names = snapshot_names(tmp_path)
    assert 'snapshot_iter_2.npz' in names, names
    assert 'snapshot_iter_3.npz' in names, names


def test_resume_prunes_an_earlier_runs_snapshots(tmp_path, data_cache,
                                                 two_snapshots):
    out = copy_of(two_snapshots, tmp_path)
    proc = train(2, out, data_cache, '--iteration', '6',
                 '--snapshot-interval', '2', '--keep-snapshots', '2',
                 '--resume', str(out / 'snapshot_iter_4.npz'))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert snapshot_names(out) == [
        'snapshot_iter_4.npz', 'snapshot_iter_4.rank0.npz',
        'snapshot_iter_4.rank1.npz', 'snapshot_iter_6.npz',
        'snapshot_iter_6.rank0.npz', 'snapshot_iter_6.rank1.npz']


def test_a_snapshot_mixing_two_writes_is_skipped(tmp_path, data_cache,
                                                 two_snapshots):
    # Rank 1's part of snapshot 4 is another run's (its newer write lost,
    # an earlier run's file of the same name left): never loaded together.
    out, other = copy_of(two_snapshots, tmp_path), tmp_path / 'other'
    assert train(2, other, data_cache, '--iteration', '4',
                 '--snapshot-interval', '4').returncode == 0
    shutil.copy(str(other / 'snapshot_iter_4.rank1.npz'),
                str(out / 'snapshot_iter_4.rank1.npz'))
    proc = train(2, out, data_cache, '--iteration', '6', '--resume',
                 str(out / 'snapshot_iter_4.npz'), timeout=120)
    assert proc.returncode != 0
    assert 'cannot resume from' in proc.stderr, proc.stderr[-3000:]
    assert 'rank 1: its files are of different writes' \
        in proc.stderr and 'rank 0:' not in proc.stderr, proc.stderr[-3000:]
    proc = train(2, out, data_cache, '--iteration', '6',
                 '--snapshot-interval', '2', '--resume', 'auto')
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'resumed from %s at iteration 2' % (out / 'snapshot_iter_2.npz') \
        in proc.stdout, proc.stdout[-3000:]
    assert 'skipping snapshot snapshot_iter_4.npz, which not every rank ' \
        'can load: rank 1: its files are of different writes ' \
        '(snapshot_iter_4.npz: write ' in proc.stderr, proc.stderr[-3000:]
    assert 'snapshot_iter_4.rank1.npz: write ' in proc.stderr


def test_keeping_no_snapshots_is_an_error(tmp_path, data_cache):
    proc = train(1, tmp_path, data_cache, '--keep-snapshots', '0',
                 '--iteration', '1', timeout=120)
    assert proc.returncode != 0
    assert '--keep-snapshots: must be at least 1' in proc.stderr, \
        proc.stderr[-3000:]


def test_the_digits_are_the_uci_test_set_split_the_same_every_time():
    import runpy
    load_digits = runpy.run_path(DIGITS)['load_digits']
    (x_train, t_train), (x_test, t_test) = load_digits()
    assert (len(x_train), len(x_test)) == (1438, 359)
    assert x_train.shape[1:] == (64,) and x_train.dtype == numpy.float32
    pixels = numpy.concatenate([x_train, x_test]) * 16
    assert pixels.min() == 0 and pixels.max() == 16
    assert numpy.array_equal(pixels, numpy.round(pixels))   # counts 0..16
    labels = numpy.concatenate([t_train, t_test])
    # The UCI test set's class sizes (sklearn's load_digits gives the same).
    assert numpy.bincount(labels).tolist() == \
        [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    (again, _), _ = load_digits()
    assert numpy.array_equal(again, x_train)


def test_digits_smoke(tmp_path):
    out = tmp_path / 'digits.json'
    code = 'import runpy\nrunpy.run_path(%r, run_name="__main__")\n' % DIGITS
    proc = run_mpi(2, code, args=['--epoch', '3', '--json', str(out),
                                  '--allreduce-grad-dtype', 'float16',
                                  '--double-buffering'], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    result = json.load(open(str(out)))
    assert result['n_ranks'] == 2 and len(result['curve']) == 3
    assert result['test_accuracy'] > 0.3  # 3x chance: it learns
