"""The .cast zip as untrusted bytes: which entries may be in it, bounded inflation, checksums
and the optional signature. kforge.package gives the entries their meaning.

Reading never trusts a size the zip declares: every entry is inflated in small chunks and
refused as soon as it, or the archive so far, passes its limit, so a zip bomb costs at most
those limits in memory and the time to inflate them.

What the checks prove. `checksums.sha256` (sha256 of every other entry) catches accidents:
a truncated copy, a flipped bit. It does not catch tampering: whoever can change a kernel
can recompute its checksums. A signature can: `kforge package --sign KEY` adds
`checksums.sha256.sig`, an Ed25519 signature of the checksums file (which covers every
entry), and `kforge.load(path, trusted_keys=[...])` refuses a package that no trusted key
signed. Without trusted keys a package loads as before and the audit says whether it was
signed.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import zipfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Iterable

from .errors import PackageError

MANIFEST = "manifest.json"
CHECKSUMS = "checksums.sha256"
SIGNATURE = "checksums.sha256.sig"
# Limits for reading untrusted zips: cubins and sources are kilobytes, a manifest a few
# megabytes at most. They bound what a hostile archive can make a reader hold in memory.
MAX_ENTRY_BYTES = 16 << 20
MAX_TOTAL_BYTES = 64 << 20
MAX_ENTRIES = 4096
_CHUNK = 1 << 16  # inflate this much at a time: a bomb is stopped within one chunk of a limit

_KERNEL_ENTRY = re.compile(r"^kernels/[0-9a-f]{16}\.(cu|sm_\d+a?\.cubin)$")
_HOST_CODE = (".py", ".pyc", ".pyo", ".pkl", ".pickle", ".pt", ".pth", ".so", ".dll", ".dylib", ".sh")
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed, so the same run packages to the same bytes
_KEYGEN = ("openssl genpkey -algorithm ed25519 -out kforge-key.pem && "
           "openssl pkey -in kforge-key.pem -pubout -out kforge-key.pub.pem")


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _unsafe(path: Path, what: str) -> PackageError:
    return PackageError(f"{path} is not a safe .cast package: {what}; refusing to load it. "
                        "Use packages written by `kforge package` from a source you trust.")


# ---- writing ------------------------------------------------------------------------------

def write_zip(out: Path, members: dict[str, bytes], sign_key: str | Path | bytes | None = None) -> None:
    """Write `members` plus their checksums (and, with `sign_key`, the checksums' signature)."""
    members = dict(members)
    members[CHECKSUMS] = "".join(f"{sha256(b)}  {name}\n" for name, b in sorted(members.items())).encode()
    if sign_key is not None:
        members[SIGNATURE] = _private_key(sign_key).sign(members[CHECKSUMS])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for name in sorted(members):
            info = zipfile.ZipInfo(name, _ZIP_TIME)
            info.external_attr = (stat.S_IFREG | 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, members[name])
    os.replace(tmp, out)


# ---- reading ------------------------------------------------------------------------------

def _check_entry(path: Path, info: zipfile.ZipInfo) -> None:
    name = info.filename
    parts = PurePosixPath(name).parts
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or "\\" in name or ".." in parts or "\0" in name:
        raise _unsafe(path, f"entry {name!r} has an absolute path or '..'")
    if stat.S_ISLNK(info.external_attr >> 16):
        raise _unsafe(path, f"entry {name!r} is a symlink")
    if name.lower().endswith(_HOST_CODE):
        raise _unsafe(path, f"entry {name!r} holds host code or a pickle; a .cast carries only CUDA source and cubins")
    if info.is_dir():
        return
    if name not in (MANIFEST, CHECKSUMS, SIGNATURE) and not _KERNEL_ENTRY.match(name):
        raise _unsafe(path, f"unexpected entry {name!r} (only {MANIFEST}, {CHECKSUMS}, {SIGNATURE} and "
                            "kernels/<card>.cu/.cubin belong)")
    # kforge writes deflate only; bzip2 and lzma inflate a whole read at once, past any chunk bound.
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise _unsafe(path, f"entry {name!r} uses compression method {info.compress_type} (only stored or deflate)")
    if info.file_size > MAX_ENTRY_BYTES:
        raise _unsafe(path, f"entry {name!r} is {info.file_size} bytes, over the {MAX_ENTRY_BYTES}-byte limit")


def _inflate(f, limit: int) -> bytes | None:
    """At most `limit` bytes of an open entry, or None if it holds more."""
    buf = bytearray()
    while chunk := f.read(_CHUNK):
        buf += chunk
        if len(buf) > limit:
            return None
    return bytes(buf)


def read_members(path: Path) -> dict[str, bytes]:
    """Every entry of the zip at `path`, each checked by name and kind and inflated within the
    limits. Raises PackageError for anything missing, corrupt, unsafe or over a limit."""
    try:
        size = path.stat().st_size
        zf = zipfile.ZipFile(path)
    except FileNotFoundError as e:
        raise PackageError(f"no package at {path}") from e
    except (zipfile.BadZipFile, OSError) as e:
        raise PackageError(f"{path} is not a readable .cast package (corrupt zip: {e}); "
                           "rebuild it with `kforge package`") from e
    with zf:
        if size > MAX_TOTAL_BYTES:
            raise _unsafe(path, f"the file is {size} bytes, over the {MAX_TOTAL_BYTES}-byte limit")
        infos = zf.infolist()
        if len(infos) > MAX_ENTRIES:
            raise _unsafe(path, f"{len(infos)} entries, over the limit of {MAX_ENTRIES}")
        members: dict[str, bytes] = {}
        declared = total = 0
        for info in infos:
            _check_entry(path, info)
            if info.is_dir():
                continue
            if info.filename in members:
                raise _unsafe(path, f"entry {info.filename!r} appears twice")
            declared += info.file_size
            if declared > MAX_TOTAL_BYTES:
                raise _unsafe(path, f"entries add up to more than {MAX_TOTAL_BYTES} bytes")
            limit = min(MAX_ENTRY_BYTES, MAX_TOTAL_BYTES - total)
            try:
                with zf.open(info) as f:
                    data = _inflate(f, limit)
            except (zipfile.BadZipFile, zlib.error, EOFError, OSError, RuntimeError, NotImplementedError) as e:
                raise PackageError(f"{path} is corrupt: entry {info.filename!r} cannot be read ({e}); "
                                   "rebuild it with `kforge package`") from e
            if data is None:
                raise _unsafe(path, f"entry {info.filename!r} inflates past the {MAX_ENTRY_BYTES}-byte limit"
                              if limit == MAX_ENTRY_BYTES else f"entries inflate to more than {MAX_TOTAL_BYTES} bytes")
            total += len(data)
            members[info.filename] = data
    return members


def verify_checksums(path: Path, members: dict[str, bytes]) -> None:
    """Every entry (but the checksums and their signature) is listed with its sha256, and is there."""
    if CHECKSUMS not in members:
        raise PackageError(f"{path} has no {CHECKSUMS}: it is not a .cast written by kforge, or it was modified")
    listed: dict[str, str] = {}
    for line in members[CHECKSUMS].decode("utf-8", "replace").splitlines():
        m = re.match(r"^([0-9a-f]{64})  (\S+)$", line)
        if not m:
            raise PackageError(f"{path}: malformed line in {CHECKSUMS}: {line[:80]!r}; rebuild the package")
        listed[m.group(2)] = m.group(1)
    for name, data in members.items():
        if name in (CHECKSUMS, SIGNATURE):
            continue
        if name not in listed:
            raise PackageError(f"{path}: entry {name!r} has no checksum; the package was modified, rebuild it")
        if sha256(data) != listed[name]:
            raise PackageError(f"{path}: checksum mismatch for {name!r}; the package is corrupt or was modified, "
                               "rebuild it with `kforge package`")
    missing = sorted(set(listed) - set(members))
    if missing:
        raise PackageError(f"{path}: {CHECKSUMS} lists entries that are missing: {missing}; rebuild the package")


# ---- signatures ---------------------------------------------------------------------------

def _crypto():
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ModuleNotFoundError as e:
        raise PackageError("package signatures need the cryptography package: pip install 'kforge[sign]'") from e
    return serialization, ed25519


def _pem(key: str | Path | bytes, what: str) -> bytes:
    if isinstance(key, bytes):
        return key
    try:
        return Path(key).read_bytes()
    except OSError as e:
        raise PackageError(f"cannot read the {what} {key}: {e.strerror}") from e


def _private_key(key: str | Path | bytes):
    serialization, ed25519 = _crypto()
    try:
        k = serialization.load_pem_private_key(_pem(key, "signing key"), password=None)
    except (ValueError, TypeError) as e:
        raise PackageError(f"the signing key is not an unencrypted PEM private key ({e}); make an Ed25519 key pair "
                           f"with: {_KEYGEN}") from e
    if not isinstance(k, ed25519.Ed25519PrivateKey):
        raise PackageError(f"the signing key must be Ed25519, not {type(k).__name__}; make one with: {_KEYGEN}")
    return k


def _public_key(key: str | Path | bytes):
    serialization, ed25519 = _crypto()
    try:
        k = serialization.load_pem_public_key(_pem(key, "trusted key"))
    except (ValueError, TypeError) as e:
        raise PackageError(f"a trusted key is not a PEM public key ({e}); give the .pub.pem of an Ed25519 pair") from e
    if not isinstance(k, ed25519.Ed25519PublicKey):
        raise PackageError(f"a trusted key must be Ed25519, not {type(k).__name__}")
    return k


def _fingerprint(public_key) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return sha256(raw)[:16]


def check_signature(path: Path, members: dict[str, bytes],
                    trusted_keys: Iterable[str | Path | bytes] | None) -> str:
    """What the package's integrity rests on, in words for the audit. With `trusted_keys`, a
    package that none of them signed raises PackageError (call after verify_checksums)."""
    signature = members.get(SIGNATURE)
    if trusted_keys is None:
        if signature is None:
            return "unsigned: checksums only, which catch corruption, not tampering"
        return "signed, signature not checked (give trusted keys to check it)"
    keys = [_public_key(k) for k in trusted_keys]
    if not keys:
        raise PackageError("trusted_keys is empty: give the public keys (PEM) whose signatures you accept")
    if signature is None:
        raise PackageError(f"{path} is not signed, and trusted keys were given: use a package written with "
                           "`kforge package --sign KEY`")
    from cryptography.exceptions import InvalidSignature

    for k in keys:
        try:
            k.verify(signature, members[CHECKSUMS])
        except InvalidSignature:
            continue
        return f"signed by trusted key {_fingerprint(k)}"
    raise PackageError(f"{path}: its signature does not match any trusted key: the package was modified after "
                       "signing or signed by another key; refusing it")
