"""A real S3-compatible server for tests: OpenStack Swift (one node, one replica) with its `s3api` middleware.

    server = S3Server(tmp_path / "s3")  # S3Server(..., tls=True): HTTPS with a self-signed cert (`ca_bundle`)
    server.start()                  # configs + rings on first start, then account/container/object/proxy servers
    server.endpoint_url             # http://127.0.0.1:PORT (use path-style addressing); region "us-east-1"
    server.access_key, server.secret_key              # owner of the buckets (tempauth "dcs:tester", .admin)
    server.other_access_key, server.other_secret_key  # "dcs:intruder": same account, no rights on any bucket
    server.set_bucket_quota("b", 1024)                # Swift container quota: a PUT that would pass it fails
    server.put_objects("b", keys, b"x")               # thousands of objects at once, through the object server
    server.kill()                   # SIGKILL the proxy (kill(everything=True): all four servers)
    server.restart()                # same ports, same data
    server.stop()

Every server is what `swift-<kind>-server CONF -v` runs (console logging into WORKDIR/logs/<kind>.log; `workers =
0`: one process, no fork) in a session of its own, forked from a zygote that imported the four server modules
once per test process (tests/helpers/swift_serve.py; DCS_TEST_SWIFT_ZYGOTE=0 runs the scripts themselves). stop/
kill signal the whole process group, and the kernel kills the servers if the test process dies without stopping
them (PR_SET_PDEATHSIG: a server dies with the zygote, which ends when the test process's pipe to it closes; a
script started directly dies with the *thread* that called start(), so start from a thread that outlives the
server, e.g. the main one). Start takes about 1.2 s (2 s without the zygote; its first start adds the zygote's
own imports). No
memcached: tempauth hands out Fernet tokens (native Swift API) and checks S3 signatures itself, so nothing is
cached between requests and container quotas see the container's current usage. Swift comes from pip alone
(`swift`; its `pyeclib` wheel bundles liberasurecode); the data directory needs user xattrs (ext4, xfs, tmpfs).

S3 error codes (swift 2.38 s3api), and what differs from AWS S3:
- Access denied: `AccessDenied` (HTTP 403) for the other user's GET/PUT/DELETE/List/CreateMultipartUpload on the
  owner's bucket (HeadBucket: bare 403). A wrong secret: `SignatureDoesNotMatch` (403). Bucket names are per
  Swift account, not global: a user of *another* account would get `NoSuchBucket` for the same name, which is
  why the other user here shares the owner's account without rights.
- Quota full: container_quotas answers 413, which s3api returns as `EntityTooLarge` (HTTP 400, message "Upload
  exceeds quota."), for PutObject, UploadPart and CompleteMultipartUpload alike, also for aws-chunked uploads
  (the check uses X-Amz-Decoded-Content-Length). Multipart parts live in the container "<bucket>+segments", so
  `set_bucket_quota` sets the quota there too (UploadPart is checked against it). The bucket's own usage counts
  a completed multipart object as its SLO manifest (a few hundred bytes), not its size: CompleteMultipartUpload
  is refused only once the bucket itself is full. ListObjects shows the real size.
- Multipart: every part but the last must be >= 5 MiB (`min_part_size`, s3api `min_segment_size`), else
  CompleteMultipartUpload fails with `EntityTooSmall`; at most 1000 parts (AWS: 10000). ETags as on AWS: MD5 hex
  of a simple object, `"<md5 of the parts' binary md5s>-<number of parts>"` of a multipart one.
- Checksums: boto3 >= 1.36 defaults (request_checksum_calculation="when_supported") work, nothing to configure:
  over HTTP it sends x-amz-checksum-crc32 as a header, over HTTPS an aws-chunked body with the checksum in a
  trailer (STREAMING-UNSIGNED-PAYLOAD-TRAILER); s3api verifies both and refuses a mismatch with `BadDigest`.
  It stores and returns no checksums: GetObject/HeadObject/UploadPart answers have no x-amz-checksum-* (boto3's
  response validation then has nothing to check). CRC32C/CRC64NVME need `awscrt` on the client side.
- Range: `bytes=a-b`, `bytes=a-`, `bytes=-n` as on AWS (206 with Content-Range); a range starting past the end
  is `InvalidRange` (416).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import pwd
import signal
import socket
import ssl
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import httpx

from tests.helpers import zygote as zygotes
from tests.helpers.ports import free_port
from tests.helpers.procs import REPO
from tests.helpers.zygote import ZygoteProcess

REGION = "us-east-1"
ACCOUNT = "dcs"
KINDS = ("account", "container", "object", "proxy")
DEVICE = "d0"
PART_POWER = 6  # of the three rings: 64 partitions, all on DEVICE
HASH_PATH = "dcs-tests"  # swift.conf's swift_hash_path_prefix and _suffix

# Builds the three rings (1 replica, one device each) with Swift's own RingBuilder: one interpreter start instead
# of nine `swift-ring-builder` runs. argv: swift_dir, device, partition power, then kind=port for account, container
# and object.
_RING_SCRIPT = """
import sys
from swift.common.ring import RingBuilder
swift_dir, device, part_power = sys.argv[1:4]
for spec in sys.argv[4:]:
    kind, port = spec.split("=")
    builder = RingBuilder(int(part_power), 1, 0)
    builder.add_dev({"id": 0, "region": 1, "zone": 1, "ip": "127.0.0.1", "port": int(port),
                     "device": device, "weight": 100.0, "meta": ""})
    builder.rebalance()
    builder.save(f"{swift_dir}/{kind}.builder")
    builder.get_ring().save(f"{swift_dir}/{kind}.ring.gz")
"""


# Runs a server (argv: the pid of the test process, then the server's command line) so that the kernel kills it
# with SIGKILL when the test process dies, however it dies (prctl PR_SET_PDEATHSIG, kept across exec): a pytest
# killed with -9 leaves no Swift server behind, although each runs in a session of its own.
_LAUNCHER = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
except (AttributeError, OSError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit("the test process is gone")
os.execv(sys.argv[2], sys.argv[2:])
"""


def swift_available() -> bool:
    """Swift (with s3api) installed for this interpreter and its server scripts next to it or on PATH. Found
    without importing it: importing any part of Swift swaps urllib.request's http.client for eventlet's green one
    in the importing process (and costs ~0.4 s of CPU); the servers run in processes of their own."""
    spec = importlib.util.find_spec("swift")
    if spec is None or not spec.submodule_search_locations:
        return False
    package = Path(next(iter(spec.submodule_search_locations)))
    if not (package / "common" / "middleware" / "s3api" / "s3api.py").is_file():
        return False
    return all(_script(kind) is not None for kind in KINDS)


def _script(kind: str) -> str | None:
    name = f"swift-{kind}-server"
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(directory) / name
        if directory and candidate.exists():
            return str(candidate)
    return None


class S3Server:
    """One Swift node answering S3 on `endpoint_url`; data, configs and logs under `workdir`."""

    def __init__(self, workdir: Path, *, min_part_size: int = 5 * 1024 * 1024, tls: bool = False) -> None:
        self.workdir = workdir.resolve()
        self.min_part_size = min_part_size
        self.tls = tls
        self.ports = {kind: free_port() for kind in KINDS}
        self.procs: dict[str, subprocess.Popen[bytes] | ZygoteProcess] = {}
        self._user = "tester"
        self._other_user = "intruder"
        self._password = base64.urlsafe_b64encode(os.urandom(18)).decode()
        self._other_password = base64.urlsafe_b64encode(os.urandom(18)).decode()
        self._fernet_key = base64.urlsafe_b64encode(os.urandom(32)).decode()
        self._configured = False

    # --- what clients need -------------------------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.ports['proxy']}"

    @property
    def ca_bundle(self) -> str | None:
        """With `tls`: the self-signed certificate of the proxy (boto3's `verify=`); None without."""
        return str(self.workdir / "etc" / "cert.pem") if self.tls else None

    def _verify(self) -> ssl.SSLContext | bool:
        return ssl.create_default_context(cafile=self.ca_bundle) if self.ca_bundle else True

    @property
    def access_key(self) -> str:
        return f"{ACCOUNT}:{self._user}"

    @property
    def secret_key(self) -> str:
        return self._password

    @property
    def other_access_key(self) -> str:
        return f"{ACCOUNT}:{self._other_user}"

    @property
    def other_secret_key(self) -> str:
        return self._other_password

    @property
    def region(self) -> str:
        return REGION

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    # --- life cycle --------------------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        """Start the four servers (configs and rings written on the first start) and wait until S3 answers."""
        if self.procs:
            raise RuntimeError("S3Server already started")
        if not self._configured:
            self._configure()
        self.logs.mkdir(exist_ok=True)
        try:
            for kind in KINDS:
                script = _script(kind)
                if script is None:
                    raise RuntimeError(f"swift-{kind}-server not found; `make test` installs swift (pip)")
                conf = str(self.workdir / "etc" / f"{kind}-server.conf")
                self.procs[kind] = self._launch(kind, script, conf, timeout)
            self._wait_ready(timeout)
        except BaseException:
            self.kill(everything=True)
            raise

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every server's process group, SIGKILL what is left after `timeout`."""
        for kind in reversed(KINDS):
            self._signal(kind, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for kind in reversed(KINDS):
            proc = self.procs.get(kind)
            if proc is None:
                continue
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self._signal(kind, signal.SIGKILL)
            proc.wait(10)
            del self.procs[kind]

    def kill(self, *, everything: bool = False) -> None:
        """kill -9 the proxy's process group (S3 stops answering; storage servers keep running), or all four."""
        for kind in reversed(KINDS) if everything else ("proxy",):
            proc = self.procs.pop(kind, None)
            if proc is None:
                continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)

    def restart(self, timeout: float = 30.0) -> None:
        """Stop whatever runs (gracefully) and start again: same ports, same data."""
        self.stop()
        self.start(timeout)

    def alive(self) -> bool:
        return len(self.procs) == len(KINDS) and all(p.poll() is None for p in self.procs.values())

    def log_tail(self, n: int = 4000) -> str:
        """The end of every server's log, for failure messages."""
        parts = []
        for kind in KINDS:
            try:
                text = (self.logs / f"{kind}.log").read_text(errors="replace")
            except FileNotFoundError:
                continue
            parts.append(f"--- {kind}-server ({self.logs / f'{kind}.log'}) ---\n{text[-n:]}")
        return "\n".join(parts)

    # --- Swift native API --------------------------------------------------------------------------------------

    def swift_token(self) -> tuple[str, str]:
        """(X-Auth-Token, storage URL) of the bucket owner, from tempauth's v1 auth (a Fernet token)."""
        answer = httpx.get(
            f"{self.endpoint_url}/auth/v1.0",
            headers={"X-Auth-User": self.access_key, "X-Auth-Key": self.secret_key},
            timeout=10,
            verify=self._verify(),
        )
        answer.raise_for_status()
        return answer.headers["X-Auth-Token"], answer.headers["X-Storage-Url"]

    def set_bucket_quota(self, bucket: str, quota_bytes: int | None, *, segments: bool = True) -> None:
        """Byte quota on the container behind `bucket` (None: remove it). `segments`: also on "<bucket>+segments",
        where s3api keeps multipart parts (created if missing), so UploadPart hits the quota too."""
        token, storage_url = self.swift_token()
        value = "" if quota_bytes is None else str(quota_bytes)
        headers = {"X-Auth-Token": token, "X-Container-Meta-Quota-Bytes": value}
        with httpx.Client(timeout=10, verify=self._verify()) as client:
            answer = client.post(f"{storage_url}/{bucket}", headers=headers)
            answer.raise_for_status()
            if segments:
                # PUT: creates the segments container if no multipart upload did yet, else only sets the quota
                answer = client.put(f"{storage_url}/{bucket}+segments", headers=headers)
                answer.raise_for_status()

    def container_usage(self, bucket: str) -> tuple[int, int]:
        """(objects, bytes) Swift counts in the container behind `bucket`."""
        token, storage_url = self.swift_token()
        answer = httpx.head(
            f"{storage_url}/{bucket}", headers={"X-Auth-Token": token}, timeout=10, verify=self._verify()
        )
        answer.raise_for_status()
        return int(answer.headers["X-Container-Object-Count"]), int(answer.headers["X-Container-Bytes-Used"])

    def put_objects(self, bucket: str, keys: Sequence[str], body: bytes, threads: int = 16) -> None:
        """Create `keys` in `bucket` (an existing one), each holding `body`, through the object server itself, as
        the proxy's PUT does (the object's file, then its row in the bucket's listing): real objects that S3 lists,
        reads and deletes like any other, for a test that needs thousands of them in place. Skipping the proxy (S3
        signature, account and container look-ups) makes each about 4x cheaper: ~3 ms of server CPU instead of ~15."""
        account = f"AUTH_{ACCOUNT}"
        container_part = _partition(account, bucket)
        update = {
            "X-Container-Host": f"127.0.0.1:{self.ports['container']}",
            "X-Container-Partition": str(container_part),
            "X-Container-Device": DEVICE,
            "X-Backend-Storage-Policy-Index": "0",
            "Content-Type": "application/octet-stream",
        }
        base = f"http://127.0.0.1:{self.ports['object']}/{DEVICE}"

        def put(client: httpx.Client, key: str) -> None:
            url = f"{base}/{_partition(account, bucket, key)}/{account}/{quote(bucket)}/{quote(key)}"
            answer = client.put(url, content=body, headers={**update, "X-Timestamp": f"{time.time():016.5f}"})
            if answer.status_code != 201:
                raise RuntimeError(f"object server refused PUT {key!r}: HTTP {answer.status_code} {answer.text[:300]}")

        with httpx.Client(timeout=30, limits=httpx.Limits(max_connections=threads)) as client:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda key: put(client, key), keys))

    # --- internals ---------------------------------------------------------------------------------------------

    def _launch(self, kind: str, script: str, conf: str, timeout: float) -> subprocess.Popen[bytes] | ZygoteProcess:
        """`swift-KIND-server CONF -v` in a session of its own, logging to `logs/KIND.log`, killed by the kernel if
        the pytest process dies: forked from this process's Swift zygote (`tests/helpers/swift_serve.py`), or,
        with DCS_TEST_SWIFT_ZYGOTE=0, the script itself run by a launcher (`_LAUNCHER`)."""
        log = self.logs / f"{kind}.log"
        if os.environ.get("DCS_TEST_SWIFT_ZYGOTE", "1") != "0":
            return zygotes.spawn(
                "swift",
                [sys.executable, "-m", "tests.helpers.swift_serve", "--zygote"],
                _zygote_env(),
                "tests.helpers.swift_serve",
                [kind, conf, "-v"],
                env=dict(os.environ),
                log=log,
                timeout=timeout,
                cwd=self.workdir,
                title=f"swift-{kind}-server {conf} -v (forked from the Swift zygote)",
                deathsig=True,
            )
        with log.open("ab") as out:
            return subprocess.Popen(
                [sys.executable, "-c", _LAUNCHER, str(os.getpid()), script, conf, "-v"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.workdir,
            )

    def _signal(self, kind: str, sig: signal.Signals) -> None:
        proc = self.procs.get(kind)
        if proc is None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def _wait_ready(self, timeout: float) -> None:
        """Poll until every server listens and an S3 ListBuckets signed as the owner succeeds (that request goes
        proxy -> s3api -> tempauth -> account server); a server that exits or a timeout raises with the logs.

        Each server's port is checked too: ListBuckets never reaches the container and object servers, and a
        GET sent before the object server listens is refused, which the proxy answers with 503 ("Please reduce
        your request rate"; a restart under load once showed it)."""
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            for kind, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"swift {kind}-server exited with {proc.returncode} during start\n{self.log_tail()}"
                    )
            deaf = [kind for kind in KINDS if not _listens(self.ports[kind])]
            if deaf:
                last = f"not listening yet: {', '.join(deaf)}"
                time.sleep(0.1)
                continue
            try:
                status, body = self._s3_list_buckets()
            except httpx.HTTPError as exc:
                last = repr(exc)
            else:
                if status == 200:
                    return
                last = f"HTTP {status}: {body[:500]!r}"
                if 400 <= status < 500:  # a refused signature or request does not heal by waiting
                    break
            time.sleep(0.1)
        raise TimeoutError(
            f"S3 (swift s3api) on {self.endpoint_url} not ready (limit {timeout}s): {last}\n{self.log_tail()}"
        )

    def _s3_list_buckets(self) -> tuple[int, str]:
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        request = AWSRequest(method="GET", url=f"{self.endpoint_url}/", headers={})
        S3SigV4Auth(Credentials(self.access_key, self.secret_key), "s3", REGION).add_auth(request)
        answer = httpx.get(request.url, headers=dict(request.headers.items()), timeout=2, verify=self._verify())
        return answer.status_code, answer.text

    def _configure(self) -> None:
        etc = self.workdir / "etc"
        devices = self.workdir / "srv"
        (devices / DEVICE).mkdir(parents=True, exist_ok=True)
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "swift.conf").write_text(
            textwrap.dedent(
                f"""\
                [swift-hash]
                swift_hash_path_suffix = {HASH_PATH}
                swift_hash_path_prefix = {HASH_PATH}

                [storage-policy:0]
                name = default
                default = yes
                """
            )
        )
        common = textwrap.dedent(
            f"""\
            [DEFAULT]
            bind_ip = 127.0.0.1
            workers = 0
            user = {pwd.getpwuid(os.getuid()).pw_name}
            swift_dir = {etc}
            devices = {devices}
            mount_check = false
            disable_fallocate = true
            fallocate_reserve = 0
            log_address = {self.workdir / "no-syslog"}
            """
        )
        for kind, app in (("account", "account"), ("container", "container"), ("object", "object")):
            (etc / f"{kind}-server.conf").write_text(
                common
                + f"bind_port = {self.ports[kind]}\nlog_name = {kind}-server\n\n"
                + f"[pipeline:main]\npipeline = {kind}-server\n\n"
                + f"[app:{kind}-server]\nuse = egg:swift#{app}\n"
            )
        if self.tls:
            _self_signed_certificate(etc / "cert.pem", etc / "key.pem")
            tls_conf = f"cert_file = {etc / 'cert.pem'}\nkey_file = {etc / 'key.pem'}\n"
        else:
            tls_conf = ""
        pipeline = (
            "catch_errors gatekeeper healthcheck proxy-logging listing_formats bulk s3api tempauth copy "
            "container-quotas account-quotas slo dlo versioned_writes symlink proxy-logging proxy-server"
        )
        filters = {
            "catch_errors": "catch_errors",
            "gatekeeper": "gatekeeper",
            "healthcheck": "healthcheck",
            "proxy-logging": "proxy_logging",
            "listing_formats": "listing_formats",
            "bulk": "bulk",
            "copy": "copy",
            "container-quotas": "container_quotas",
            "account-quotas": "account_quotas",
            "slo": "slo",
            "dlo": "dlo",
            "versioned_writes": "versioned_writes",
            "symlink": "symlink",
        }
        sections = "".join(f"[filter:{name}]\nuse = egg:swift#{egg}\n\n" for name, egg in filters.items())
        (etc / "proxy-server.conf").write_text(
            common
            + f"bind_port = {self.ports['proxy']}\nlog_name = proxy-server\n{tls_conf}\n"
            + f"[pipeline:main]\npipeline = {pipeline}\n\n"
            + textwrap.dedent(
                f"""\
                [app:proxy-server]
                use = egg:swift#proxy
                account_autocreate = true
                allow_account_management = true
                # one node: never stop sending to it after errors (a restarted server is used at once)
                error_suppression_limit = 1000000
                error_suppression_interval = 1

                [filter:s3api]
                use = egg:swift#s3api
                location = {REGION}
                min_segment_size = {self.min_part_size}

                [filter:tempauth]
                use = egg:swift#tempauth
                user_{ACCOUNT}_{self._user} = {self._password} .admin
                user_{ACCOUNT}_{self._other_user} = {self._other_password}
                fernet_key_1 = {self._fernet_key}
                active_fernet_key_id = 1

                """
            )
            + sections
        )
        rings = subprocess.run(
            [sys.executable, "-c", _RING_SCRIPT, str(etc), DEVICE, str(PART_POWER)]
            + [f"{kind}={self.ports[kind]}" for kind in ("account", "container", "object")],
            capture_output=True,
            text=True,
            cwd=self.workdir,
        )
        if rings.returncode != 0:
            raise RuntimeError(f"building the swift rings failed ({rings.returncode}):\n{rings.stderr[-4000:]}")
        self._configured = True


def _zygote_env() -> dict[str, str]:
    """The Swift zygote's environment: this process's, with the repository importable (its children get the
    environment of the test that starts them)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _listens(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def _partition(account: str, container: str, obj: str | None = None) -> int:
    """The ring partition of an account/container[/object] path (swift.common.ring.Ring.get_part with this
    server's hash path prefix and suffix, without loading the ring)."""
    path = "/".join(p for p in (account, container, obj) if p is not None)
    digest = hashlib.md5(f"{HASH_PATH}/{path}{HASH_PATH}".encode(), usedforsecurity=False).digest()
    return int(struct.unpack_from(">I", digest)[0]) >> (32 - PART_POWER)


def _self_signed_certificate(cert_path: Path, key_path: Path) -> None:
    """An ECDSA key and a certificate for 127.0.0.1 / localhost, valid for two days (cryptography is a dependency
    of swift)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dcs-test-s3")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def main() -> int:
    """`python -m tests.helpers.s3server -- CMD...`: run CMD with a Swift S3 server up, a bucket `bench` made and
    AWS_ENDPOINT_URL / AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_DEFAULT_REGION set (`make bench-storage`)."""
    import shutil
    import tempfile

    import boto3
    from botocore.config import Config

    command = sys.argv[1:]
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("usage: python -m tests.helpers.s3server -- COMMAND [ARGS]", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="dcs-s3-bench-"))
    server = S3Server(workdir)
    server.start()
    try:
        env = {
            **os.environ,
            "AWS_ENDPOINT_URL": server.endpoint_url,
            "AWS_ACCESS_KEY_ID": server.access_key,
            "AWS_SECRET_ACCESS_KEY": server.secret_key,
            "AWS_DEFAULT_REGION": server.region,
        }
        client = boto3.client(
            "s3",
            endpoint_url=server.endpoint_url,
            aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key,
            region_name=server.region,
            config=Config(s3={"addressing_style": "path"}),
        )
        client.create_bucket(Bucket="bench")
        return subprocess.run(command, env=env, check=False).returncode
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
