"""Kernel struct member offsets from the running kernel's BTF (/sys/kernel/btf/vmlinux).

bcc compiles its programs against kernel headers; on a host whose headers are not the running
kernel's own (these machines: Debian 6.1 headers under a 6.18 kernel) any `task->files` in the
program would use the headers' layout and read garbage. So the inspector's program never
dereferences a kernel struct by type: it reads raw memory at offsets computed here from the
kernel's own type information, which is exact for the kernel that is running.

Only what the inspector needs is implemented: types are indexed in one pass, and struct or
union members are resolved on demand, descending into anonymous members.
"""

from __future__ import annotations

import struct
from pathlib import Path

VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")

_MAGIC = 0xEB9F
(K_INT, K_PTR, K_ARRAY, K_STRUCT, K_UNION, K_ENUM, K_FWD, K_TYPEDEF, K_VOLATILE, K_CONST,
 K_RESTRICT, K_FUNC, K_FUNC_PROTO, K_VAR, K_DATASEC, K_FLOAT, K_DECL_TAG, K_TYPE_TAG,
 K_ENUM64) = range(1, 20)
_MODIFIERS = (K_TYPEDEF, K_VOLATILE, K_CONST, K_RESTRICT, K_TYPE_TAG)


class BTFError(Exception):
    pass


class BTF:
    def __init__(self, data: bytes) -> None:
        if len(data) < 24:
            raise BTFError("BTF data too short")
        magic, _ver, _flags, hdr_len = struct.unpack_from("<HBBI", data, 0)
        if magic != _MAGIC:
            raise BTFError(f"bad BTF magic {magic:#x} (not little-endian BTF?)")
        type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", data, 8)
        self._data = data
        self._strs = hdr_len + str_off
        self._str_end = self._strs + str_len
        # Type id -> (kind, kind_flag, vlen, name_off, size_or_type, offset of the tail).
        self._types: list[tuple[int, int, int, int, int, int]] = [(0, 0, 0, 0, 0, 0)]
        self._by_name: dict[str, list[int]] = {}
        pos, end = hdr_len + type_off, hdr_len + type_off + type_len
        unpack = struct.unpack_from
        while pos < end:
            name_off, info, st = unpack("<III", data, pos)
            kind = (info >> 24) & 0x1F
            vlen = info & 0xFFFF
            kflag = info >> 31
            tail = pos + 12
            if kind in (K_INT, K_VAR, K_DECL_TAG):
                size = 4
            elif kind == K_ARRAY:
                size = 12
            elif kind in (K_STRUCT, K_UNION, K_DATASEC, K_ENUM64):
                size = 12 * vlen
            elif kind in (K_ENUM, K_FUNC_PROTO):
                size = 8 * vlen
            else:
                size = 0
            tid = len(self._types)
            self._types.append((kind, kflag, vlen, name_off, st, tail))
            if kind in (K_STRUCT, K_UNION) and name_off:
                self._by_name.setdefault(self._str(name_off), []).append(tid)
            pos = tail + size

    @classmethod
    def load(cls, path: Path = VMLINUX_BTF) -> BTF:
        try:
            return cls(path.read_bytes())
        except OSError as e:
            raise BTFError(f"cannot read {path}: {e.strerror}") from e

    def _str(self, off: int) -> str:
        end = self._data.index(b"\0", self._strs + off)
        return self._data[self._strs + off:end].decode()

    def _resolve(self, tid: int) -> int:
        while self._types[tid][0] in _MODIFIERS:
            tid = self._types[tid][4]
        return tid

    def _members(self, tid: int):
        kind, kflag, vlen, _n, _s, tail = self._types[tid]
        for i in range(vlen):
            name_off, mtype, moff = struct.unpack_from("<III", self._data, tail + 12 * i)
            bits = moff & 0xFFFFFF if kflag else moff
            yield (self._str(name_off) if name_off else ""), mtype, bits

    def _find(self, tid: int, member: str) -> tuple[int, int] | None:
        """(bit offset, member type id) of `member` in struct/union `tid`, looking inside
        anonymous struct/union members too."""
        for name, mtype, bits in self._members(tid):
            if name == member:
                return bits, mtype
            if not name:
                inner = self._resolve(mtype)
                if self._types[inner][0] in (K_STRUCT, K_UNION):
                    found = self._find(inner, member)
                    if found is not None:
                        return bits + found[0], found[1]
        return None

    def offset(self, struct_name: str, member: str) -> int:
        """Byte offset of `member` in `struct struct_name` (a dotted path descends into
        nested struct members: "signal.live")."""
        candidates = self._by_name.get(struct_name)
        if not candidates:
            raise BTFError(f"struct {struct_name} not in BTF")
        errors = []
        for tid in candidates:
            if self._types[tid][0] != K_STRUCT or self._types[tid][2] == 0:
                continue
            total, cur, ok = 0, tid, True
            for part in member.split("."):
                found = self._find(cur, part)
                if found is None:
                    ok = False
                    break
                bits, mtype = found
                if bits % 8:
                    raise BTFError(f"{struct_name}.{member} is a bit field")
                total += bits // 8
                cur = self._resolve(mtype)
            if ok:
                return total
            errors.append(tid)
        raise BTFError(f"struct {struct_name} has no member {member}")

    def size(self, struct_name: str) -> int:
        for tid in self._by_name.get(struct_name, []):
            if self._types[tid][0] == K_STRUCT and self._types[tid][2]:
                return self._types[tid][4]
        raise BTFError(f"struct {struct_name} not in BTF")
