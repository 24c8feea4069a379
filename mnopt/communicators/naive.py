from mnopt.communicators.flat import FlatCommunicator


class NaiveCommunicator(FlatCommunicator):
    """One MPI Allreduce per gradient array: the simple reference the other
    communicators are checked against."""

    name = 'naive'

    def _buffer_options(self):
        return {'per_array': True}  # and every array goes through packing
