"""Streaming's fragments (``local_steps=H, fragments=F``): which
parameters form each fragment, and at which local steps each is synced.

The parameters, in the order of their names, are cut into F contiguous
fragments of about equal bytes (whole arrays: an array is never split),
so each sync sends about 1/F of the model.  Fragment f is synced after
the local steps s where ``(s - f*H/F) % H == 0`` (Streaming DiLoCo's
schedule), so some fragment is on the wire every H/F steps and each
fragment every H."""


def split_by_bytes(named_sizes, fragments):
    """``[(name, nbytes), ...]`` (in a fixed order) cut into ``fragments``
    contiguous lists of names of about equal bytes; a fragment may be
    empty where there are fewer arrays than fragments."""
    total = sum(size for _, size in named_sizes)
    out = [[] for _ in range(fragments)]
    done = 0
    for name, size in named_sizes:
        # The fragment this array's middle falls in: cuts land at
        # k*total/F, each array on the side that holds most of it.
        middle = done + size / 2.0
        index = min(fragments - 1, int(middle * fragments / total)) \
            if total else 0
        out[index].append(name)
        done += size
    return out


def starting(step, local_steps, fragments):
    """The fragments whose sync starts after local step ``step`` (1 is
    the first local step)."""
    stride = local_steps // fragments
    return [f for f in range(fragments)
            if step >= 1 and (step - f * stride) % local_steps == 0]
