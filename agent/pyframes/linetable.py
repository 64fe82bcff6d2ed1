"""Line numbers from a code object's line table, one decoder per format.

- 3.9  co_lnotab: (bytecode-offset increment, signed line increment) byte pairs; f_lasti in bytes.
- 3.10 co_linetable: (bytecode length, signed line delta; -128 = no line) pairs; f_lasti in code units.
- 3.11+ co_linetable, the "location table": entries of 1..8 code units, each a header byte
  (bit 7 set, code in bits 3-6, length-1 in bits 0-2) followed by varints for the code's form.
Each decoder takes the table bytes, co_firstlineno and a byte offset into the bytecode, and returns the
line as co_positions() has it: -1 for an instruction without a location (exception cleanup, an implicit
return). With carry=True such an instruction gets the line of the entry before it instead, as py-spy reports
it (the running line of the table); -1 then only means the offset is outside the table or it is corrupt.
"""

from __future__ import annotations


def line_lnotab39(table: bytes, firstlineno: int, byte_offset: int, carry: bool = False) -> int:
    """(co_lnotab has no "no line" entries: `carry` changes nothing.)"""
    line = firstlineno
    addr = 0
    for i in range(0, len(table) - 1, 2):
        addr += table[i]
        if addr > byte_offset:
            break
        delta = table[i + 1]
        line += delta - 256 if delta >= 128 else delta
    return line


def line_linetable310(table: bytes, firstlineno: int, byte_offset: int, carry: bool = False) -> int:
    line = firstlineno
    start = 0
    for i in range(0, len(table) - 1, 2):
        sdelta = table[i]
        ldelta = table[i + 1]
        ldelta = ldelta - 256 if ldelta >= 128 else ldelta
        end = start + sdelta
        if ldelta == -128:
            current = line if carry else -1
        else:
            line += ldelta
            current = line
        if start <= byte_offset < end:
            return current
        start = end
    return -1


def _varint(table: bytes, i: int) -> tuple[int, int]:
    b = table[i]
    i += 1
    val = b & 63
    shift = 0
    while b & 64:
        b = table[i]
        i += 1
        shift += 6
        val |= (b & 63) << shift
    return val, i


def _svarint(table: bytes, i: int) -> tuple[int, int]:
    val, i = _varint(table, i)
    return (-(val >> 1) if val & 1 else val >> 1), i


def line_locations311(table: bytes, firstlineno: int, byte_offset: int, carry: bool = False) -> int:
    target = byte_offset // 2  # code units
    line = firstlineno
    unit = 0
    i = 0
    n = len(table)
    while i < n:
        first = table[i]
        i += 1
        if not first & 0x80:
            return -1  # not at an entry boundary: a corrupt or misread table
        code = (first >> 3) & 15
        length = (first & 7) + 1
        if code == 15:        # no location
            current = line if carry else -1
        elif code == 14:      # long form: line delta, end line delta, start col, end col
            delta, i = _svarint(table, i)
            line += delta
            current = line
            _, i = _varint(table, i)
            _, i = _varint(table, i)
            _, i = _varint(table, i)
        elif code == 13:      # no column
            delta, i = _svarint(table, i)
            line += delta
            current = line
        elif code >= 10:      # one-line forms: line delta = code - 10, two column bytes
            line += code - 10
            current = line
            i += 2
        else:                 # short form: same line, one column byte
            current = line
            i += 1
        if unit <= target < unit + length:
            return current
        unit += length
    return -1


DECODERS = {"lnotab39": line_lnotab39, "linetable310": line_linetable310, "locations311": line_locations311}
