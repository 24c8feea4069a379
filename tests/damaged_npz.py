"""Damage a snapshot's bytes as a bad disk or a stray write would (not a
file cut short: that is a zip without its directory)."""

import zipfile


def damage_deflate_stream(path, nbytes=4096):
    """Overwrite up to ``nbytes`` at the start of the largest deflated
    member's data with 0xff bytes: a deflate block of the reserved type,
    so reading it raises ``zlib.error`` (not ``BadZipFile``) every time."""
    _overwrite_data(path, _largest(path, zipfile.ZIP_DEFLATED), nbytes)


def damage_stored_member(path, nbytes=4096):
    """Overwrite up to ``nbytes`` at the start of the largest stored
    (uncompressed) member's data with 0xff bytes: the member reads, but
    no longer matches its CRC-32."""
    _overwrite_data(path, _largest(path, zipfile.ZIP_STORED), nbytes)


def _largest(path, compress_type):
    with zipfile.ZipFile(path) as z:
        return max((i for i in z.infolist()
                    if i.compress_type == compress_type),
                   key=lambda i: i.compress_size)


def _overwrite_data(path, member, nbytes):
    with open(path, 'r+b') as f:
        f.seek(member.header_offset + 26)   # the local header's lengths
        lengths = f.read(4)
        start = (member.header_offset + 30 + int.from_bytes(lengths[:2],
                 'little') + int.from_bytes(lengths[2:], 'little'))
        f.seek(start)
        f.write(b'\xff' * min(nbytes, member.compress_size))
