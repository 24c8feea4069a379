
import sys
sys.path.insert(0, 'tests')
import numpy, mnopt
import test_sign as t
options = {'vote': sys.argv[2]} if len(sys.argv) > 2 else {}
comm = mnopt.create_communicator(sys.argv[1], compression='sign', **options)
for step in range(2):
    got = t._vote_once(comm, seed=step)
    if step == 0:
        everyone = [t.rank_grads(r, step) for r in range(comm.size)]
        for g, w in zip(got, t.expected_vote(everyone, step)):
            assert (g == w).all()
    for other in comm.allgather_obj(got):
        assert all((a == b).all() for a, b in zip(other, got))
if sys.argv[1] == 'reduction_server':
    n = 1 + 2001 + 3 + 35 + 429  # elements: 1 bit each way per element
    assert comm.vote_stats['bytes_sent'] == (n + 7) // 8
print('OK vote %d of %d' % (comm.rank, comm.size))
