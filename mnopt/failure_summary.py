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
rank is also writing a summary (so that one block is written, by the
first failure: an exception before a stall, then the lowest rank).  It
registers itself here (``set_peers``): this leaf starts no MPI.

Leaf module: imports only the standard library and mnopt.log.
"""

import json
import logging
import os
import socket
import time

from mnopt import log

logger = log.get(__name__)

#: The folder a launcher gives the ranks for their records.
FOLDER_VARIABLE = 'MNOPT_FAILURE_DIR'
#: How long a failing rank waits for the others' answers (seconds).
PEERS_WAIT_S = 1.5
#: Which failure's block is written when several ranks fail at once:
#: the lowest (an exception or an exit explains a stall, not the reverse).
PRIORITY = {'uncaught exception': 0, 'exit': 0, 'signal': 0, 'stall': 1}

_peers = _reported_to = None
_reported = False


def set_peers(ask, reported):
    """``ask(priority, wait_s, question)`` -> (others, first): what every
    other rank said it was doing ({name: text}, or None where there is no
    one to ask or ``question`` is False) and whether this rank's failure
    is the one to report (no other rank claimed an earlier one);
    ``reported()`` tells them that this rank has reported.  The stall
    watchdog's."""
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
            'time': time.time()}


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
    others = rec.get('others')
    if others:
        out.append('the other ranks at that moment:')
        out += ['  %s: %s' % (name, others[name])
                for name in sorted(others, key=_natural)]
    elif others is not None:
        out.append('the other ranks: not asked (no mnopt communicator '
                   'was running)')
    out.append('end of the failure summary')
    return out


def report(how, what, traceback='', others=None, who=None):
    """Report a failure once per process: ask the other ranks what they
    do (unless ``others`` says it already), hear whether another rank
    reports an earlier failure, and where none does, write the record to
    $MNOPT_FAILURE_DIR (under mnopt.launch) or the block on stderr.
    ``who``: the rank that failed, where not this one.  Returns whether
    this rank reported; never raises."""
    global _reported
    if _reported:
        return False
    _reported = True
    try:
        first, asked = True, None
        if _peers is not None:
            asked, first = _peers(PRIORITY.get(how, 0), PEERS_WAIT_S,
                                  others is None)
        if not first:
            return False
        if others is None:
            others = {} if asked is None else asked
        rec = record(how, what, traceback, others, who=who)
        if not _write_record(rec, 'failure'):
            log.say(logger, logging.ERROR, '%s', '\n'.join(lines(rec)),
                    last_words=True)
            log.flush(__name__)
        if _reported_to is not None:
            _reported_to()
        return True
    except Exception:
        return False


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
        return min(failures, key=lambda r: (PRIORITY.get(r['how'], 0),
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
        return dict(record('signal', what, rank=rank), who='rank %s' % rank,
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
    out = lines(rec, header)
    if rec.get('others') is None:
        ended_ranks = sorted(r for r in found['start']
                             if str(r) != str(rec['rank']))
        if ended_ranks:
            out.insert(-1, 'the other ranks: %s ended with the job' %
                       ', '.join('rank %d' % r for r in ended_ranks))
    return out
