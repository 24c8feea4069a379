"""The hosts of an elastic relaunch (``python -m mnopt.launch --hosts ...
| --hostfile F``, or inside a Slurm allocation): a list ``h1,h2,...``, an
MPI host file, or Slurm's compressed node list, read into host names and,
where a host file says so, the processes per host.

A host file is read in the forms MPI launchers and schedulers write: one
host a line, or a line per slot (``$PBS_NODEFILE``, MPICH's machine
file: a host repeated is one host with as many slots), ``host:4``
(MPICH's Hydra), ``host slots=4 max_slots=8`` (Open MPI; ``max_slots``
and other settings ignored), ``#`` comments, tabs and CRLF line ends.
The slots are the processes per host; every host must have the same
number (the launcher starts as many on each; ``--procs-per-node`` may
start fewer: slots are a maximum).  A name with more than one colon is
an IPv6 address (``fe80::1 slots=2``), not ``host:N``.
"""

import os
import re


def parse_host_list(text):
    """``h1,h2,...`` as a list of names (empty items dropped);
    ValueError for a host named twice."""
    hosts = [h.strip() for h in text.split(',') if h.strip()]
    twice = sorted({h for h in hosts if hosts.count(h) > 1})
    if twice:
        raise ValueError('host %s is named twice: name each host once (the '
                         'processes per host are --procs-per-node)'
                         % ', '.join(twice))
    return hosts


def _slots(path, line, text):
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError('%s: %r: %r is no number of slots (give a whole '
                         'number >= 1)' % (path, line, text))
    return count


def _host_line(path, line):
    """(name, its slots or None) of one line of a host file."""
    fields = line.split()
    # host:N where one colon is: more are an IPv6 address's (fe80::1).
    name, colon, count = fields[0].partition(':') \
        if fields[0].count(':') == 1 else (fields[0], '', '')
    slots = _slots(path, line, count) if colon else None
    for field in fields[1:]:
        key, _, value = field.partition('=')
        if key == 'slots':
            slots = _slots(path, line, value)
    if not name or re.search(r'[\[\],]', name):
        raise ValueError(
            '%s: %r is no host name: write one host a line, each by its '
            'full name (no [ranges]; for Slurm\'s node lists use --hosts '
            '"$(scontrol show hostnames | paste -sd,)")' % (path, line))
    return name, slots


def read_hostfile_slots(path):
    """``(hosts, slots)`` of an MPI host file (see the module's doc):
    the hosts in the order first named, and the processes per host, or
    None where the file names each host once and gives no slots;
    ValueError where the hosts have different numbers of slots."""
    counts, given = {}, False
    with open(path) as f:   # universal newlines: CRLF too
        for line in f:
            line = line.split('#', 1)[0].strip()
            if not line:
                continue
            name, slots = _host_line(path, line)
            given = given or slots is not None or name in counts
            counts[name] = counts.get(name, 0) + (slots or 1)
    if not given:
        return list(counts), None
    if len(set(counts.values())) > 1:
        raise ValueError(
            '%s gives the hosts different numbers of slots (%s): mnopt.launch '
            'starts as many processes on each host; give every host the '
            'same number, or name each host once, without slots, and give '
            '--procs-per-node P' % (path, ', '.join(
                '%s: %d' % hc for hc in counts.items())))
    return list(counts), next(iter(counts.values()), None)


def read_hostfile(path):
    """The hosts of an MPI host file (see ``read_hostfile_slots``)."""
    return read_hostfile_slots(path)[0]


def _expand_range(ranges):
    names = []
    for part in ranges.split(','):
        if '-' in part:
            first, last = part.split('-', 1)
            if int(last) < int(first):
                raise ValueError('the range %s is reversed (Slurm refuses '
                                 'it too): write it lowest first' % part)
            names += ['%0*d' % (len(first), n)
                      for n in range(int(first), int(last) + 1)]
        else:
            names.append(part)
    return names


def _not_a_list(text, item, why=''):
    return ValueError('%r is not a Slurm node list (at %r%s): give the hosts '
                      'as --hosts h1,h2,...' % (text, item, why))


def _expand_name(item, text):
    """One name of a node list, each bracket expanded (``rack[1-2]-n[01-02]``
    is four names, the last bracket varying fastest, as Slurm's)."""
    found = re.match(r'^([^\[\]]*)\[([0-9,-]+)\](.*)$', item)
    if found is None:
        if '[' in item or ']' in item:
            raise _not_a_list(text, item)
        return [item]
    prefix, ranges, rest = found.groups()
    try:
        middles = _expand_range(ranges)
    except ValueError as e:
        said = str(e)
        raise _not_a_list(text, item, ': ' + said if 'reversed' in said
                          else '')
    return [prefix + m + tail for m in middles
            for tail in _expand_name(rest, text)]


def expand_slurm_nodelist(text):
    """Slurm's compressed node list (``node[01-03,07],gpu5``,
    ``rack[1-2]-node[01-02]``) as names, as ``scontrol show hostnames``
    prints them; ValueError for a list it cannot read (a reversed range
    ``node[3-1]`` too)."""
    items = re.findall(r'(?:[^,\[]|\[[^\]]*\])+', text)
    if ','.join(items) != text.strip(','):
        raise ValueError('%r is not a Slurm node list: give the hosts as '
                         '--hosts h1,h2,...' % text)
    return [h for item in items for h in _expand_name(item, text) if h]


def hosts_and_slots(hosts=None, hostfile=None, environ=None):
    """``(hosts, slots)``: the hosts given (``--hosts``, ``--hostfile``, or
    Slurm's ``SLURM_JOB_NODELIST``) and the processes per host a host
    file gives (else None); ValueError saying what to give where no
    hosts are."""
    environ = os.environ if environ is None else environ
    if hosts:
        return parse_host_list(hosts), None
    if hostfile:
        return read_hostfile_slots(hostfile)
    if environ.get('SLURM_JOB_NODELIST'):
        return parse_host_list(','.join(expand_slurm_nodelist(
            environ['SLURM_JOB_NODELIST']))), None
    raise ValueError('no hosts: give --hosts h1,h2,..., --hostfile FILE, '
                     'or run inside a Slurm allocation (SLURM_JOB_NODELIST)')


def hosts_from(hosts=None, hostfile=None, environ=None):
    """The hosts of ``hosts_and_slots``."""
    return hosts_and_slots(hosts, hostfile, environ)[0]
