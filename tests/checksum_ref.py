"""The vault checksum written out plainly from docs/vault.md ("Checksums"), in pure Python, to
check libsmoe's smoe_checksum against the spec rather than against itself. Slow (a table lookup
per byte): for kilobytes, not the whole vault."""

_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (0x82F63B78 ^ (_c >> 1)) if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c(data: bytes) -> int:
    """Plain CRC-32C (iSCSI): reflected 0x82F63B78, init and final xor 0xFFFFFFFF."""
    c = 0xFFFFFFFF
    for b in bytes(data):
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def checksum(data: bytes) -> int:
    """4 lanes: m = (n // 32) * 8; lanes 0..2 are [i*m, (i+1)*m), lane 3 is [3m, n); the result
    is the CRC-32C of the four lane CRCs, each little-endian."""
    data = bytes(data)
    n = len(data)
    m = n // 32 * 8
    bounds = [0, m, 2 * m, 3 * m, n]
    lanes = [crc32c(data[bounds[i]:bounds[i + 1]]) for i in range(4)]
    return crc32c(b"".join(c.to_bytes(4, "little") for c in lanes))
