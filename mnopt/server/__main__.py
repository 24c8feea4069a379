"""``python -m mnopt.server``: a reduction server process
(mnopt/server/process.py)."""

from mnopt.server import process

if __name__ == '__main__':
    process.main()
