"""One failure summary (torchrun's ``ChildFailedError`` block): when a job
fails, which rank failed first, how (an uncaught exception, a signal, an
exit, a stall), its traceback once, and what the other ranks were doing,
said once, at the end.

Under a plain ``mpiexec`` the rank that fails (or, in a stall, the first
to time out) writes the block on stderr before it aborts the job
(``report``).  Under ``python -m mnopt.launch`` the launcher gives the
ranks a folder in ``$MNOPT_FAILURE_DIR``: each rank notes there at start
who it is (``note_start``: its pid and host, and Python's fault handler's
file, which catches SIGSEGV and its kin), a failing rank writes its record
there instead of the block, and the launcher prints the block after each
failed attempt (``read_folder``, ``launcher_block``).

What the other ranks were doing comes from the stall watchdog, which asks
them over its monitors and hears, bounded by ``PEERS_WAIT_S``, which other
ranks fail too (so that one block is written, by the first failure: an
exception before a stall, then the lowest rank; it names the others'
failures, one line each, or says that every rank raised the same error).
It registers itself here (``set_peers``): this leaf starts no MPI.  Before
any communicator (and so the watchdog) is up, the failing ranks hear each
other over MPI's COMM_WORLD where MPI runs (``_world_claims``, bounded by
``WORLD_WAIT_S``); before MPI starts, nothing can be heard, so each rank
that fails then writes its own block.

Leaf module: imports only the standard library and mnopt.common.log.
"""

import json
import logging
import os
import socket
import time

from mnopt.common import log

logger = log.get('mnopt.failure_summary')   # its name before common/

#: The folder a launcher gives the ranks for their records.
FOLDER_VARIABLE = 'MNOPT_FAILURE_DIR'
#: How long a failing rank waits for the others' answers (seconds).
PEERS_WAIT_S = 1.5
#: Which failure's block is written when several ranks fail at once:
#: the lowest (an exception or an exit explains a stall, not the reverse).
PRIORITY = {'uncaught exception': 0, 'exit': 0, 'signal': 0, 'stall': 1}
#: How long a failing rank listens for the others' claims over
#: COMM_WORLD where no watchdog runs yet (seconds).
WORLD_WAIT_S = 0.5
#: The tag of those claims on COMM_WORLD (the watchdog has its own
#: communicators; before it, COMM_WORLD is the only one every rank has).
WORLD_TAG = 0x57A5

_peers = _reported_to = None
_reported = False


def set_peers(ask, reported):
    """``ask(claim, wait_s, question)`` -> (others, first, also): what
    every other rank said it was doing ({name: text}, or None where there
    is no one to ask or ``question`` is False), whether this rank's
    failure is the one to report (no other rank claimed an earlier one),
    and the failures the other ranks claimed ({name: (how, line)});
    ``claim`` is (priority, how, line).  ``reported()`` tells them that
    this rank has reported.  The stall watchdog's."""
    global _peers, _reported_to
    _peers, _reported_to = ask, reported


def _this_rank():
    rank, _ = log.job_rank()
    return 0 if rank is None else rank


def record(how, what, traceback='', others=None, rank=None, who=None):
    """A failure as the launcher reads it back: ``rank`` is the rank
    that writes it (this one), ``who`` the one that failed, where another
    (a rank that exited before an operation the writer waits in)."""
    rank = _this_rank() if rank is None else rank
    return {'rank': rank, 'who': who or 'rank %d' % rank,
            'pid': os.getpid(), 'host': socket.gethostname(),
            'how': how, 'what': what, 'traceback': traceback or '',
            'others': None if others is None else dict(others),
            'also': {}, 'size': log.job_rank()[1], 'time': time.time()}


def one_line(how, what, traceback=''):
    """What a failure raised, in one line: an exception's last line
    ('ValueError: bad batch'), else ``what``."""
    last = [line for line in (traceback or '').split('\n') if line.strip()]
    return last[-1].strip() if how == 'uncaught exception' and last \
        else what


def _natural(name):
    """'rank 10' after 'rank 9'."""
    head, _, number = name.rpartition(' ')
    return (head, int(number)) if number.isdigit() else (name, 0)


def lines(rec, header='mnopt: failure summary'):
    """The block's lines for one failure record."""
    who = rec.get('who') or 'rank %s' % rec['rank']
    if who == 'rank %s' % rec['rank']:
        where = ' (pid %s on %s)' % (rec.get('pid', '?'),
                                     rec.get('host', '?'))
    else:
        where = ' (reported by rank %s)' % rec['rank']
    out = [header, 'first failure: %s%s: %s: %s' % (
        who, where, rec['how'], rec['what'])]
    if rec.get('traceback'):
        out.append('its traceback:')
        out += ['  ' + line
                for line in rec['traceback'].rstrip('\n').split('\n')]
    others = dict(rec.get('others') or {})
    also = dict(rec.get('also') or {})
    mine = one_line(rec['how'], rec['what'], rec.get('traceback'))
    same = sorted((n for n in also if tuple(also[n]) ==
                   (rec['how'], mine)), key=_natural)
    if also and len(same) == len(also) == rec.get('size', 0) - 1:
        # The usual case: mnopt refuses a setting on every rank alike.
        out.append('the other ranks: every rank %s (%s too)' % (
            'raised the same error' if rec['how'] == 'uncaught exception'
            else 'failed the same way', ', '.join(same)))
        return out + ['end of the failure summary']
    for name, (how, line) in also.items():
        others[name] = 'also failed: the same error' if name in same else \
            'also failed (%s): %s' % (how, line)
    if others:
        out.append('the other ranks at that moment:')
        out += ['  %s: %s' % (name, others[name])
                for name in sorted(others, key=_natural)]
    if rec.get('others') == {}:
        out.append('%s: not asked (no mnopt communicator was running)' % (
            '  the others' if also else 'the other ranks'))
    out.append('end of the failure summary')
    return out


def report(how, what, traceback='', others=None, who=None):
    """Report a failure once per process: claim it to the other ranks,
    ask them what they do (unless ``others`` says it already) and hear
    which of them fail too; where none claims an earlier failure, write
    the record to $MNOPT_FAILURE_DIR (under mnopt.launch) or the block on
    stderr, naming the others' failures.  Under mnopt.launch a rank whose
    failure is not the first writes its record too (the launcher's block
    names it).  ``who``: the rank that failed, where not this one.
    Returns whether this rank reported; never raises."""
    global _reported
    if _reported:
        return False
    _reported = True
    try:
        when = time.time()
        line = one_line(how, what, traceback)
        claim = (PRIORITY.get(how, 0), how, line if who is None else None)
        if _peers is not None:
            asked, first, also = _peers(claim, PEERS_WAIT_S, others is None)
        else:
            asked, (first, also) = None, _world_claims(claim)
        if others is None:
            others = {} if asked is None else asked
        rec = record(how, what, traceback, others if first else None,
                     who=who)
        rec.update(also=also if first else {}, first=first, time=when)
        if not first:
            _write_record(rec, 'failure')
            return False
        if _reported_to is not None:
            _reported_to()
        if not _write_record(rec, 'failure'):
            log.say(logger, logging.ERROR, '%s', '\n'.join(lines(rec)),
                    last_words=True, on_stderr=True)
            log.flush(logger.name)
        return True
    except Exception:
        return False


def _world_claims(claim):
    """(first, also) heard over COMM_WORLD, where MPI runs with several
    ranks and no watchdog does (a failure before the first communicator
    is up, as a setting refused in create_communicator on every rank):
    this rank's claim to every other rank, then the others' heard for
    WORLD_WAIT_S.  The lowest (priority, rank) reports; none where one
    has reported already.  (True, {}) where MPI does not run."""
    import sys
    mpi = sys.modules.get('mpi4py.MPI')
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return True, {}
    world = mpi.COMM_WORLD
    if world.size < 2:
        return True, {}
    mine = (claim[0], world.rank)
    for r in range(world.size):
        if r != world.rank:
            world.isend(mine + (False,) + tuple(claim[1:]), dest=r,
                        tag=WORLD_TAG)
    claims = []
    status = mpi.Status()
    deadline = time.monotonic() + WORLD_WAIT_S
    while time.monotonic() < deadline:
        while world.iprobe(mpi.ANY_SOURCE, WORLD_TAG, status):
            claims.append(world.recv(source=status.Get_source(),
                                     tag=WORLD_TAG))
        time.sleep(0.01)
    first = all(not c[2] and mine <= tuple(c[:2]) for c in claims)
    if first:   # the others, failing later, leave theirs unsaid
        for r in range(world.size):
            if r != world.rank:
                world.isend(mine + (True, None, None), dest=r,
                            tag=WORLD_TAG)
    return first, also_failed(claims, lambda rank: 'rank %d' % rank)


def also_failed(claims, name_of):
    """{name: (how, line)} of the other ranks' failure claims
    ((priority, rank, done, how, line), ``name_of(rank)`` its name)."""
    return {name_of(c[1]): (c[3], c[4]) for c in claims
            if len(c) > 4 and c[3] is not None and c[4] is not None}


def _record_path(rank, kind):
    folder = os.environ.get(FOLDER_VARIABLE)
    if not folder or not os.path.isdir(folder):
        return None
    return os.path.join(folder, 'rank-%d.%s' % (rank, kind))


def _write_record(rec, kind):
    """Write ``rec`` to the launcher's folder; False where there is none
    (or it cannot be written: the block goes to stderr then)."""
    path = _record_path(int(rec['rank']), kind)
    if path is None:
        return False
    try:
        with open(path + '.tmp', 'w') as f:
            json.dump(rec, f)
        os.replace(path + '.tmp', path)
        return True
    except OSError:
        return False


_fault_file = None


def note_start():
    """Under mnopt.launch: note this rank's pid and host in the folder
    (so the launcher can name a rank that a signal ended), and point
    Python's fault handler at a file there (its traceback on SIGSEGV,
    SIGBUS, SIGFPE, SIGABRT, SIGILL)."""
    global _fault_file
    rank, size = log.job_rank()
    path = None if rank is None or size < 2 else _record_path(rank, 'start')
    if path is None:
        return
    try:
        _write_record(dict(record('start', '', rank=rank)), 'start')
        import faulthandler
        _fault_file = open(_record_path(rank, 'fault'), 'w')
        faulthandler.enable(file=_fault_file, all_threads=True)
    except (OSError, RuntimeError, ValueError):
        pass


def read_folder(folder):
    """{'start': {rank: record}, 'failure': {rank: record}, 'fault':
    {rank: text}} from a launcher's folder."""
    found = {'start': {}, 'failure': {}, 'fault': {}}
    try:
        names = os.listdir(folder)
    except OSError:
        return found
    for name in names:
        parts = name.split('.')
        if len(parts) != 2 or not parts[0].startswith('rank-') or \
                parts[1] not in found or not parts[0][5:].isdigit():
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                text = f.read()
            found[parts[1]][int(parts[0][5:])] = \
                text if parts[1] == 'fault' else json.loads(text)
        except (OSError, ValueError):
            pass
    return found


def signal_name(number):
    import signal
    try:
        return signal.Signals(number).name
    except ValueError:
        return 'signal %d' % number


def first_failure(found, ended=None):
    """The record to report from a launcher's folder: the earliest
    failure of the lowest priority; else a rank whose fault handler wrote
    (a fatal signal); else the rank the MPI launcher said a signal ended
    (``ended``: {'pid', 'host', 'signal', and 'rank' where it said it}
    or None); else None."""
    failures = list(found['failure'].values())
    if failures:
        # The ranks' own choice first (a rank that heard of an earlier
        # failure marked its record not first).
        return min(failures, key=lambda r: (not r.get('first', True),
                                            PRIORITY.get(r['how'], 0),
                                            r['time'], int(r['rank'])))
    for rank in sorted(found['fault']):
        text = found['fault'][rank].strip()
        if text:
            start = found['start'].get(rank, {})
            what = text.split('\n', 1)[0]
            return dict(record('signal', what.replace(
                'Fatal Python error: ', ''), rank=rank),
                who='rank %d' % rank,
                pid=start.get('pid', '?'), host=start.get('host', '?'),
                traceback='\n'.join(
                    line for line in text.split('\n')[1:]
                    if line.strip() and not line.startswith('Extension ')),
                others=None)
    if ended is not None:
        rank = ended.get('rank')
        if rank is None:
            rank = next((r for r, s in sorted(found['start'].items())
                         if s.get('pid') == ended['pid'] and
                         _same_host(s.get('host'), ended.get('host'))), '?')
        start = found['start'].get(rank, {})
        what = 'killed by %s' % signal_name(ended['signal'])
        if ended.get('rank') is None:
            # MPICH's Hydra names the first process it saw end, and ends
            # the others by the same signal: it may name one of them.
            what += ', as mpiexec reports it (it ends the other ranks ' \
                'by SIGKILL too, so it may name one of them)'
        return dict(record('signal', what, rank=rank, who='rank %s' % rank),
            pid=ended.get('pid') or start.get('pid', '?'),
            host=ended.get('host') or start.get('host', '?'), others=None)
    return None


def _same_host(a, b):
    """Whether two names are one host (a short name and its FQDN too)."""
    return a is None or b is None or a.split('.')[0] == b.split('.')[0]


def launcher_block(found, status, attempt, attempts, ended=None):
    """The launcher's block after a failed attempt (its lines)."""
    header = 'mnopt.launch: failure summary of attempt %d of %d ' \
        '(exit status %d)' % (attempt, attempts, status)
    rec = first_failure(found, ended)
    if rec is None:
        return [header, 'first failure: not known: no rank left a '
                'record (a rank ended by a signal mpiexec did not name, or '
                'a failure outside mnopt); look for the first error above',
                'end of the failure summary']
    rec = dict(rec, also=dict(rec.get('also') or {},
                              **_other_failures(found, rec)))
    ended_ranks = {'rank %d' % r: 'ended with the job'
                   for r in found['start'] if str(r) != str(rec['rank'])
                   and 'rank %d' % r not in rec['also']}
    if rec.get('others') is None and rec['also'] and ended_ranks:
        rec['others'] = ended_ranks
    out = lines(rec, header)
    if rec.get('others') is None:
        ended_ranks = sorted(r for r in found['start']
                             if str(r) != str(rec['rank']) and
                             'rank %d' % r not in rec['also'])
        if ended_ranks:
            out.insert(-1, 'the other ranks: %s ended with the job' %
                       ', '.join('rank %d' % r for r in ended_ranks))
    return out


def _other_failures(found, first):
    """{name: (how, line)}: the failures of their own that ranks other
    than ``first``'s wrote to the launcher's folder."""
    also = {}
    for rank, rec in sorted(found['failure'].items()):
        who = 'rank %s' % rank
        if rec.get('who', who) == who and who != first.get('who'):
            also[who] = (rec['how'], one_line(
                rec['how'], rec['what'], rec.get('traceback')))
    return also
