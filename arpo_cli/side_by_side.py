"""What two `arpo run`s on one host must not share, settled before any child process starts.

Owns: the ports a local run listens on and its run id. :func:`claim_host` resolves them once, in the config that
`arpo run` then writes to ``<run>/config.toml`` (every child reads that file, and ``--resume`` starts from it), so
each process of the run sees the same, concrete values.

Rules (the config's docstrings say the same):

- ``serve.port = 0`` (the default): a free TCP port on ``serve.host``, the kernel's pick for port 0 (as
  ``arpo view --port 0``). Any other value is used as given, after a check that nothing listens on it (a bind
  with SO_REUSEADDR, as arpo-serve's own listening socket is made); a busy one is refused with one line naming the
  key (:class:`PortInUse`).
- ``transport.endpoint = "tcp://HOST:0"`` (the default; ZeroMQ's ``*`` port too): the same for the learner's
  ROUTER; ``tcp://HOST:PORT`` is checked; ``ipc://`` and ``inproc://`` endpoints are used as given.
- ``actors.inference_urls`` left at its default becomes this run's own arpo-serve (``http://<serve.host, or
  127.0.0.1 for a wildcard address>:<port>``): `arpo run`'s actors and learner use the server it starts. Any
  other value must name that server (it may name more), else it is refused: they would train against a server
  this run does not own. On ``--resume`` the URL the first start filled in counts as unset, so
  ``--set serve.port=0`` moves a resumed run to a new free port.
- ``run_id`` left empty on a fresh run: ``<the folder's name, at most 15 characters>-<8 hex digits of a hash of
  its absolute path>``, so two runs whose folders share a name (``a/demo``, ``b/demo``) label their desktops
  (``arpo.run``), name their socket folders (``/tmp/arpo-desktops/<run id>``, cut at 24 characters) and tell
  their learners apart (an actor of another run is refused) differently. A resumed run keeps its file's run id.

Race: a port is free when it is picked, and another program may take it in the seconds before the child binds it.
Then arpo-serve or the learner fails to bind and the run stops naming its log; the launcher trusts a /health
answer only once its own arpo-serve logged its ready line for that port (:func:`ready_line_seen`), so a run is
never answered by another run's server, and a learner of another run refuses this run's actors (run id).
Weight groups (learner.weight_sync = "distributed") take a fresh kernel-picked port per join already
(learner.train.publisher), so they never need a key. The tiny policy two fresh runs under one folder share
(``<runs>/tiny-model``) appears in one rename of a finished folder (:func:`create_tiny_model_once`).
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import re
import shutil
import socket
import tempfile
from pathlib import Path

from arpo_async.config import ActorConfig, ConfigError, RunConfig, load_config

AUTO_PORTS = ("0", "*")
"""The port of a tcp:// endpoint that means "a free one" (ZeroMQ binds either to a port the kernel picks)."""
WILDCARD_HOSTS = ("", "*", "0.0.0.0", "::", "[::]")
"""Listen addresses that mean every interface; clients of this host reach them on loopback."""
READY_LINE = re.compile(r"arpo-serve ready on http://\S+:(\d+)")
"""arpo-serve's ready line (arpo_serve.main), printed once its port is bound; group 1 is the port."""
RUN_ID_NAME_CHARS = 15
"""Characters of the folder name kept in a derived run id (+ '-' + 8 hex digits = 24, the socket folder's cut)."""


class PortInUse(ConfigError):
    """A port the config names explicitly is taken (or cannot be listened on); the message names the key."""


def _bind_probe(host: str, port: int) -> int:
    """Bind a TCP socket (SO_REUSEADDR) to ``host``:``port`` and close it; returns the bound port (the kernel's
    pick when ``port`` is 0). Raises OSError (EADDRINUSE: something listens there)."""
    host = "" if host in WILDCARD_HOSTS else host.strip("[]")
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
        return probe.getsockname()[1]


def claim_port(key: str, host: str, port: int) -> int:
    """The port to listen on for ``key``: a free one on ``host`` when ``port`` is 0, else ``port`` once checked.

    Raises:
        PortInUse: ``port`` is taken on ``host`` (``"<key> = <port> is in use on <host> (another run?); ..."``),
            or ``host`` cannot be listened on at all.
    """
    try:
        return _bind_probe(host, port)
    except OSError as e:
        where = host or "every address"
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(f"{key} = {port} is in use on {where} (another run?); choose another or leave it unset "
                            "for a free one") from None
        raise PortInUse(f"{key}: cannot listen on {where} port {port}: {e.strerror or e}") from None


def client_host(host: str) -> str:
    """The address a process of this host connects to for a server listening on ``host`` (loopback for a
    wildcard; IPv6 in brackets, as URLs write it)."""
    if host in WILDCARD_HOSTS:
        return "127.0.0.1"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def claim_endpoint(endpoint: str) -> str:
    """``transport.endpoint`` with its port resolved: ``tcp://HOST:0`` (or ``:*``) gets a free port on HOST, any
    other tcp:// port is checked; ipc:// and inproc:// come back unchanged.

    Raises:
        PortInUse: the port is taken, or HOST cannot be listened on.
    """
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return endpoint
    host, _, port = rest.rpartition(":")
    if port not in AUTO_PORTS and not port.isdigit():
        raise ConfigError(f"transport.endpoint = {endpoint!r}: the port must be a number, 0 or * (a free one)")
    chosen = claim_port("transport.endpoint", host, 0 if port in AUTO_PORTS else int(port))
    return f"tcp://{host}:{chosen}"


def own_urls(urls: tuple[str, ...], own: str, derived: tuple[str, ...] = ()) -> tuple[str, ...]:
    """``actors.inference_urls`` for a run whose own server is ``own``: the default, or ``derived`` (what an earlier
    start of this run filled in), becomes ``(own,)``; a value that names ``own`` is kept.

    Raises:
        ConfigError: any other value (it does not name ``own``).
    """
    if urls in (ActorConfig().inference_urls, derived):
        return (own,)
    if own.rstrip("/") not in {u.rstrip("/") for u in urls}:
        raise ConfigError(f"actors.inference_urls = {list(urls)} does not name this run's own arpo-serve ({own}, "
                          "from serve.host and serve.port): `arpo run` trains against the server it starts; leave "
                          "actors.inference_urls unset and it is filled in")
    return urls


def derived_run_id(run_dir: str | Path) -> str:
    """The run id of a fresh run with ``run_id`` unset: the folder's name (letters, digits, ``-_.``, at most
    RUN_ID_NAME_CHARS) + ``-`` + the first 8 hex digits of SHA-256 of its absolute path."""
    path = Path(run_dir).resolve()
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", path.name)[:RUN_ID_NAME_CHARS].strip("-.") or "run"
    return f"{name}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def claim_host(config: RunConfig, *, resume: bool) -> RunConfig:
    """``config`` with what a local run takes on this host resolved (module docstring): serve.port,
    transport.endpoint, actors.inference_urls, and run_id on a fresh run.

    Raises:
        PortInUse: an explicit port is taken.
        ConfigError: actors.inference_urls names other servers only; a malformed endpoint port.
    """
    serve = config.serve
    port = claim_port("serve.port", serve.host, serve.port)
    urls = own_urls(config.actors.inference_urls, f"http://{client_host(serve.host)}:{port}",
                    _derived_before(config.run_path) if resume else ())
    return dataclasses.replace(
        config, run_id=config.run_id or ("" if resume else derived_run_id(config.run_dir)),
        serve=dataclasses.replace(serve, port=port),
        transport=dataclasses.replace(config.transport, endpoint=claim_endpoint(config.transport.endpoint)),
        actors=dataclasses.replace(config.actors, inference_urls=urls))


def _derived_before(run: Path) -> tuple[str, ...]:
    """The inference URLs an earlier start of the run in ``run`` filled in (its config.toml names its own server
    alone), so a resumed run on another serve.port follows its new server; () when there are none."""
    try:
        saved = load_config(run / "config.toml")
    except ConfigError:
        return ()
    own = (own_server_url(saved),)
    return own if saved.actors.inference_urls == own else ()


def own_server_url(config: RunConfig) -> str:
    """The URL of the arpo-serve `arpo run` starts for ``config`` (serve.host and serve.port, resolved)."""
    return f"http://{client_host(config.serve.host)}:{config.serve.port}"


def log_size(path: Path) -> int:
    """The size of ``path`` in bytes (0 when missing): where a child's lines start in a log it appends to."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def ready_line_seen(log_path: Path, since: int, port: int) -> bool:
    """Whether ``log_path``, past byte ``since``, holds arpo-serve's ready line (:data:`READY_LINE`) for ``port``:
    proof that the server answering on that port is the one that logs there."""
    try:
        with log_path.open("rb") as log:
            log.seek(since)
            text = log.read().decode(errors="replace")
    except OSError:
        return False
    return any(int(m[1]) == port for m in READY_LINE.finditer(text))


def create_tiny_model_once(model: Path) -> None:
    """Create the tiny random policy (arpo_async.model.init_model.create_tiny_model) at ``model`` by writing it into
    a fresh hidden folder beside it and renaming that into place, so a run that starts while another creates it
    never reads a half-written model: when the other run's rename came first, this copy is removed and its model
    used.

    Raises:
        OSError: ``model`` is a non-empty folder without config.json (not a model), or the folder cannot be written.
    """
    from arpo_async.model.init_model import create_tiny_model

    model.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=model.parent))
    try:
        create_tiny_model(staging)
        try:
            staging.rename(model)  # atomic; refused when model is a non-empty folder
        except OSError:
            if not (model / "config.json").is_file():
                raise
    finally:
        if staging.is_dir() and not staging.is_symlink():
            shutil.rmtree(staging)
