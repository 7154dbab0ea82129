"""deploy/: every file is linted and schema-checked, and every `epdq` command line in it is parsed
by the real CLI, so that the compose file, the Kubernetes manifests, the systemd units and the
README cannot drift from the code unnoticed.

- YAML: yamllint (programmatic, fixed config).
- Kubernetes: kubernetes-validate's bundled schemas (offline), strict, against fixed versions.
- Compose: the Compose Specification's JSON schema, vendored in tests/data (offline; no docker).
- systemd: a parser check of sections and keys always; `systemd-analyze verify` where installed.
- Wiring: same node id and shared /dev/shm for encoder + PD, CURVE keys read-only at --keys-dir,
  health checks on the ports that really serve /health.
Each validator also gets a deliberately broken input that it must reject.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import typer
import typer.main
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from cli.main import app

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"
COMPOSE_FILES = (DEPLOY / "compose.yaml", DEPLOY / "compose.gpu.yaml")
COMPOSE_SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"
COMPOSE_SCHEMA_SOURCE = ROOT / "tests" / "data" / "compose-spec.json.SOURCE"
K8S_MANIFESTS = ("namespace.yaml", "broker.yaml", "worker.yaml", "gateway.yaml")
K8S_VERSIONS = ("1.29.0", "1.33.0")  # oldest and newest minor we claim to support
UNITS = ("epdq-broker.service", "epdq-encoder@.service", "epdq-pd@.service", "epdq-gateway.service")
KEYS_DIR = "/etc/epdq/keys"
SECRET_NAME = "epdq-curve-keys"

YAMLLINT_CONFIG = YamlLintConfig("""
extends: default
rules:
  document-start: disable
  line-length: {max: 130}
  comments: {min-spaces-from-content: 2}
  truthy: {allowed-values: ["true", "false"], check-keys: true}
  octal-values: {forbid-implicit-octal: true, forbid-explicit-octal: true}
""")


def _yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _k8s_docs() -> list[tuple[str, dict]]:
    return [(name, d) for name in K8S_MANIFESTS for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _find(kind: str, name: str) -> dict:
    found = [d for _, d in _k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} documents"
    return found[0]


# ------------------------------------------------------------------ the CLI as the judge of flags

_GROUP = typer.main.get_command(app)


def parse_epdq(argv: list[str]) -> dict:
    """Parse `epdq ARGV...` exactly as the CLI would (no resilient parsing); return the params.
    Raises typer.TyperException (unknown option, bad value, missing required) or KeyError (command)."""
    assert argv, "empty epdq command line"
    if argv[0] == "bench":
        raise AssertionError("deploy files should not run benchmarks")
    cmd = _GROUP.commands[argv[0]]  # KeyError: no such subcommand
    ctx = cmd.make_context(argv[0], list(argv[1:]), resilient_parsing=False)
    with ctx:
        return dict(ctx.params)


def _options(argv: list[str]) -> dict[str, str]:
    """--flag value pairs of an already parsed (known-good) command line."""
    out, i = {}, 1
    while i < len(argv):
        if argv[i].startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[argv[i]] = argv[i + 1]
            i += 2
        else:
            out[argv[i]] = ""
            i += 1
    return out


_SHELL_STOP = {";", "&&", "||", "|", "&", "(", ")"}


def _epdq_in_shell(script: str) -> list[list[str]]:
    """Every `epdq ...` (or `/path/to/epdq ...`) command in a shell snippet, up to the next operator."""
    found = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True  # '#' starts a comment (shlex's default commenters)
        tokens = list(lexer)
        for i, tok in enumerate(tokens):
            if tok.rsplit("/", 1)[-1] != "epdq":
                continue
            if (
                i == 0
                or tokens[i - 1] in _SHELL_STOP | {"exec", "sudo"}
                or tokens[i - 2 : i] == ["-u", "epdq"]
            ):
                argv = []
                for t in tokens[i + 1 :]:
                    if t in _SHELL_STOP:
                        break
                    argv.append(t)
                found.append(argv)
    return found


def _compose_interpolate(value: str) -> str:
    """Compose's ${VAR:-default} / ${VAR-default} / ${VAR} with the environment empty ($$ is $)."""
    value = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)
    return value.replace("$$", "$")


def compose_invocations(path: Path = DEPLOY / "compose.yaml") -> dict[str, list[str]]:
    """service -> argv after `epdq` (the image's entrypoint is epdq; command holds the arguments)."""
    services = _load(path)["services"]
    out = {}
    for name, svc in services.items():
        if "command" not in svc:
            continue
        assert isinstance(svc["command"], list), f"{name}: use the list form of command"
        assert "entrypoint" not in svc, f"{name}: the image's entrypoint is epdq"
        out[name] = [_compose_interpolate(str(a)) for a in svc["command"]]
    return out


def _containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def k8s_invocations() -> dict[str, list[str]]:
    """deployment/container -> argv after `epdq`; containers with their own command run no epdq."""
    out = {}
    for _, doc in _k8s_docs():
        if doc["kind"] != "Deployment":
            continue
        for c in _containers(doc["spec"]["template"]["spec"]):
            key = f"{doc['metadata']['name']}/{c['name']}"
            if "command" in c:
                script = " ".join(c["command"][2:]) if c["command"][:2] == ["/bin/sh", "-c"] else ""
                assert not _epdq_in_shell(script) and "epdq" not in c["command"][0], key
                continue
            out[key] = [str(a) for a in c["args"]]
    return out


# ------------------------------------------------------------------ systemd unit parsing

SYSTEMD_KEYS = {
    "Unit": {
        "Description",
        "Documentation",
        "After",
        "Before",
        "Wants",
        "Requires",
        "BindsTo",
        "PartOf",
        "ConditionPathExists",
        "StartLimitIntervalSec",
        "StartLimitBurst",
    },
    "Service": {
        "Type",
        "User",
        "Group",
        "Environment",
        "EnvironmentFile",
        "ExecStart",
        "ExecStartPre",
        "ExecReload",
        "Restart",
        "RestartSec",
        "KillSignal",
        "KillMode",
        "TimeoutStopSec",
        "TimeoutStartSec",
        "StateDirectory",
        "StateDirectoryMode",
        "CacheDirectory",
        "RuntimeDirectory",
        "WorkingDirectory",
        "NoNewPrivileges",
        "ProtectSystem",
        "ProtectHome",
        "PrivateTmp",
        "PrivateIPC",
        "RemoveIPC",
        "ProtectKernelTunables",
        "ProtectControlGroups",
        "LimitNOFILE",
        "LimitMEMLOCK",
    },
    "Install": {"WantedBy", "RequiredBy", "Alias", "DefaultInstance"},
}


def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """Sections -> [(key, value)] in order (systemd keys repeat, so no dict); raises ValueError."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    lines = text.replace("\\\n", " ").splitlines()
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            if not line.endswith("]") or line[1:-1] not in SYSTEMD_KEYS:
                raise ValueError(f"line {n}: unknown section {line!r}")
            current = sections.setdefault(line[1:-1], [])
            continue
        key, eq, value = line.partition("=")
        key = key.strip()
        if current is None or not eq:
            raise ValueError(f"line {n}: not KEY=VALUE inside a section: {line!r}")
        section = next(s for s, v in sections.items() if v is current)
        if key not in SYSTEMD_KEYS[section]:
            raise ValueError(f"line {n}: unknown key {key!r} in [{section}]")
        current.append((key, value.strip()))
    return sections


def _unit_env(sections: dict) -> dict[str, str]:
    env = {}
    for key, value in sections["Service"]:
        if key == "Environment":
            for item in shlex.split(value):
                k, _, v = item.partition("=")
                env[k] = v
    return env


def unit_invocation(sections: dict) -> list[str]:
    """ExecStart's epdq arguments, with ${VAR} taken from the unit's Environment= defaults."""
    exec_start = [v for k, v in sections["Service"] if k == "ExecStart"]
    assert len(exec_start) == 1
    env = _unit_env(sections)
    missing = set(re.findall(r"\$\{(\w+)\}", exec_start[0])) - set(env)
    assert not missing, f"ExecStart uses variables without a default: {missing}"
    argv = shlex.split(exec_start[0])
    # systemd: "${VAR}" as its own word becomes exactly one argument, even when empty
    argv = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], a) for a in argv]
    assert argv[0] == "/opt/epdq/.venv/bin/epdq", argv[0]
    return argv[1:]


def systemd_verify(unit_dir: Path) -> list[str]:
    """Problems `systemd-analyze verify` reports for the units in unit_dir (the epdq path pointed at
    this venv's, templates instantiated as @0); [] when clean."""
    epdq = Path(sys.executable).with_name("epdq")
    assert os.access(epdq, os.X_OK), f"{epdq} missing: the project is not installed in this venv"
    work = unit_dir.parent / f"{unit_dir.name}-verify"
    work.mkdir()
    paths = []
    for unit in sorted(unit_dir.glob("*.service")):
        target = work / unit.name.replace("@.", "@0.")
        target.write_text(unit.read_text().replace("/opt/epdq/.venv/bin/epdq", str(epdq)))
        paths.append(str(target))
    r = subprocess.run(["systemd-analyze", "verify", *paths], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "SYSTEMD_LOG_COLOR": "0"}, cwd=work)  # fmt: skip
    problems = [
        ln
        for ln in (r.stdout + r.stderr).splitlines()
        if str(work) in ln or re.search(r"unknown|ignoring|invalid|failed|not executable", ln, re.I)
    ]
    if r.returncode != 0 and not problems:
        problems = [f"systemd-analyze verify exited {r.returncode}: {r.stderr.strip()}"]
    return problems


# ================================================================== tests: inventory


def test_deploy_files_exist():
    for rel in ("README.md", "Dockerfile", "compose.yaml", "compose.gpu.yaml", "k8s/kustomization.yaml",
                *(f"k8s/{m}" for m in K8S_MANIFESTS), *(f"systemd/{u}" for u in UNITS),
                "systemd/epdq.env.example"):  # fmt: skip
        assert (DEPLOY / rel).is_file(), rel
    # nothing unlisted slips past the checks below
    assert {p.name for p in K8S.glob("*.y*ml")} == {*K8S_MANIFESTS, "kustomization.yaml"}
    assert {p.name for p in SYSTEMD.glob("*.service")} == set(UNITS)
    assert set(_yaml_files()) == {
        *COMPOSE_FILES,
        K8S / "kustomization.yaml",
        *(K8S / m for m in K8S_MANIFESTS),
    }


# ================================================================== tests: YAML lint


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yamllint_clean(path: Path):
    problems = list(linter.run(path.read_text(), YAMLLINT_CONFIG, str(path)))
    assert not problems, "\n".join(f"{path.name}:{p.line}:{p.column} {p.rule}: {p.desc}" for p in problems)


def test_yamllint_rejects_broken_yaml():
    broken = (K8S / "broker.yaml").read_text().replace("  replicas: 1\n", "  replicas: 1\n  replicas: 2\n", 1)
    broken = broken.replace("defaultMode: 288", "defaultMode: 0440", 1)
    rules = {p.rule for p in linter.run(broken, YAMLLINT_CONFIG)}
    assert {"key-duplicates", "octal-values"} <= rules


# ================================================================== tests: Kubernetes schemas


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifests_validate_strict(version: str):
    docs = _k8s_docs()
    kinds = sorted((d["kind"], d["metadata"]["name"]) for _, d in docs)
    assert kinds == [("Deployment", "epdq-broker"), ("Deployment", "epdq-gateway"), ("Deployment", "epdq-worker"),
                     ("Namespace", "epdq"), ("Service", "epdq-broker"), ("Service", "epdq-gateway")]  # fmt: skip
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(
                f"{name} {doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}"
            )


def test_k8s_validator_rejects_broken_manifests():
    good = _find("Deployment", "epdq-worker")
    kubernetes_validate.validate(good, K8S_VERSIONS[-1], strict=True)
    typo = copy.deepcopy(good)
    typo["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []  # unknown field (strict)
    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["replicas"] = "two"
    no_image = copy.deepcopy(good)
    del no_image["spec"]["template"]["spec"]["containers"][1]["name"]  # required
    for bad in (typo, wrong_type, no_image):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest():
    k = _load(K8S / "kustomization.yaml")
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    assert sorted(k["resources"]) == sorted(K8S_MANIFESTS)
    assert k["namespace"] == _find("Namespace", "epdq")["metadata"]["name"]
    images = {c["image"].split(":")[0] for _, d in _k8s_docs() if d["kind"] == "Deployment"
              for c in _containers(d["spec"]["template"]["spec"])}  # fmt: skip
    assert images == {i["name"] for i in k["images"]}


# ================================================================== tests: Compose schema


def _compose_validator() -> jsonschema.Draft7Validator:
    text = COMPOSE_SCHEMA.read_bytes()
    recorded = re.search(r"sha256:\s+([0-9a-f]{64})", COMPOSE_SCHEMA_SOURCE.read_text()).group(1)
    assert hashlib.sha256(text).hexdigest() == recorded, "vendored compose-spec.json differs from its record"
    schema = json.loads(text)
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_validates_against_spec(path: Path):
    errors = sorted(_compose_validator().iter_errors(_load(path)), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_compose_validator_rejects_broken_files():
    validator = _compose_validator()
    good = _load(DEPLOY / "compose.yaml")
    assert not list(validator.iter_errors(good))
    typo = copy.deepcopy(good)
    typo["services"]["encoder"]["shm-size"] = "1gb"  # the key is shm_size
    wrong_type = copy.deepcopy(good)
    wrong_type["services"]["broker"]["healthcheck"]["retries"] = [3]  # number or string only
    bad_dep = copy.deepcopy(good)
    bad_dep["services"]["pd"]["depends_on"]["encoder"]["condition"] = "service_ready"
    for bad in (typo, wrong_type, bad_dep):
        assert list(validator.iter_errors(bad))


# ================================================================== tests: systemd


@pytest.mark.parametrize("unit", UNITS)
def test_systemd_unit_parses(unit: str):
    sections = parse_unit((SYSTEMD / unit).read_text())
    assert set(sections) == {"Unit", "Service", "Install"}
    service = dict(sections["Service"])  # last value per key is enough for these
    assert service["User"] == "epdq" and service["NoNewPrivileges"] == "yes"
    assert dict(sections["Install"])["WantedBy"] == "multi-user.target"
    assert "EnvironmentFile" in service and service["EnvironmentFile"] == "-/etc/epdq/epdq.env"
    argv = unit_invocation(sections)
    assert _options(argv)["--keys-dir"] == KEYS_DIR
    if argv[0] == "worker":  # ring segments live in the host's /dev/shm, shared by the user's workers
        assert service.get("PrivateIPC", "no") == "no" and service.get("RemoveIPC", "no") == "no"
        assert "DynamicUser" not in service


def test_systemd_env_example_matches_units():
    example = {}
    for line in (SYSTEMD / "epdq.env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            example[k] = v
    used = {}
    for unit in UNITS:
        env = _unit_env(parse_unit((SYSTEMD / unit).read_text()))
        for k, v in env.items():
            if k.startswith("EPDQ_") and k != "EPDQ_HOME":
                assert used.setdefault(k, v) == v, f"{k}: different defaults across units"
    assert example == used


def test_systemd_parser_rejects_broken_units():
    good = (SYSTEMD / "epdq-broker.service").read_text()
    parse_unit(good)
    for bad in (good.replace("RestartSec=1", "RestartSecs=1"), good.replace("[Install]", "[Instal]"),
                good.replace("Restart=on-failure", "Restart on-failure")):  # fmt: skip
        with pytest.raises(ValueError):
            parse_unit(bad)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed "
                    "(test_systemd_unit_parses still checks the units)")  # fmt: skip
def test_systemd_analyze_verify(tmp_path: Path):
    units = tmp_path / "units"
    shutil.copytree(SYSTEMD, units)
    assert systemd_verify(units) == []
    broken = tmp_path / "broken"
    broken.mkdir()
    text = (SYSTEMD / "epdq-broker.service").read_text()
    (broken / "epdq-broker.service").write_text(text.replace("RestartSec=1", "RestartSecs=1"))
    assert systemd_verify(broken), "systemd-analyze verify accepted an unknown key"


# ================================================================== tests: every epdq command line


def _all_invocations() -> dict[str, list[str]]:
    found = {f"compose:{k}": v for k, v in compose_invocations().items()}
    found |= {f"k8s:{k}": v for k, v in k8s_invocations().items()}
    for unit in UNITS:
        found[f"systemd:{unit}"] = unit_invocation(parse_unit((SYSTEMD / unit).read_text()))
    for i, cmd in enumerate(
        re.findall(r"^RUN (.*?)(?<!\\)$", (DEPLOY / "Dockerfile").read_text(), re.M | re.S)
    ):
        for j, argv in enumerate(_epdq_in_shell(cmd)):
            found[f"Dockerfile:RUN{i}.{j}"] = argv
    readme = (DEPLOY / "README.md").read_text()
    for i, block in enumerate(re.findall(r"```(?:bash|sh|console)\n(.*?)```", readme, re.S)):
        for j, argv in enumerate(_epdq_in_shell(block)):
            found[f"README:block{i}.{j}"] = argv
    return found


def test_every_epdq_command_line_parses():
    found = _all_invocations()
    by_source = {}
    for key in found:
        by_source[key.split(":")[0]] = by_source.get(key.split(":")[0], 0) + 1
    # the collectors must really find the command lines, or this test would pass vacuously
    assert by_source["compose"] == 5 and by_source["k8s"] == 4 and by_source["systemd"] == 4
    assert by_source["Dockerfile"] >= 1 and by_source["README"] >= 2
    failures = []
    for key, argv in found.items():
        try:
            params = parse_epdq(argv)
        except (typer.TyperException, KeyError) as e:
            failures.append(f"{key}: epdq {shlex.join(argv)}: {getattr(e, 'message', e)!s}")
            continue
        if argv[0] == "worker":
            if params["role"] not in ("encoder", "pd", "both") or params["engine"] not in (
                "auto",
                "hf",
                "noop",
            ):
                failures.append(f"{key}: bad --role/--engine {params['role']}/{params['engine']}")
        if argv[0] in ("broker", "worker", "serve-http") and params["insecure"]:
            failures.append(f"{key}: --insecure in a deployment")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "argv",
    [
        ["worker", "--role", "pd", "--nodes", "a"],  # no such option
        ["broker", "--metrics"],  # option without its value
        ["worker", "--broker", "tcp://b:7700"],  # --role is required
        ["worker", "--role", "encoder", "--ring-mb", "lots"],  # not an int
        ["serve-http", "--port", "$(PORT)"],  # an unexpanded placeholder in an int option
    ],
)
def test_cli_check_rejects_bad_command_lines(argv):
    with pytest.raises(typer.TyperException):
        parse_epdq(argv)


def test_cli_check_rejects_unknown_subcommand():
    with pytest.raises(KeyError):
        parse_epdq(["encoder", "--role", "pd"])


def test_shell_extraction_finds_commands():
    script = (
        "set -e\nsudo -u epdq /opt/epdq/.venv/bin/epdq keygen /etc/epdq/keys && echo ok\n"
        "exec epdq worker --role pd \\\n  --node n1 # comment\nnot-epdq --x"
    )
    assert _epdq_in_shell(script) == [
        ["keygen", "/etc/epdq/keys"],
        ["worker", "--role", "pd", "--node", "n1"],
    ]


# ================================================================== tests: wiring (compose)


def test_compose_wiring():
    services = _load(DEPLOY / "compose.yaml")["services"]
    argv = compose_invocations()
    opts = {name: _options(a) for name, a in argv.items()}
    assert set(argv) == {"keygen", "broker", "encoder", "pd", "gateway"}
    assert [argv["encoder"][:3], argv["pd"][:3]] == [
        ["worker", "--role", "encoder"],
        ["worker", "--role", "pd"],
    ]
    # the encoder/PD pair is one node: same --node id, one IPC namespace and /dev/shm, big enough
    assert opts["encoder"]["--node"] == opts["pd"]["--node"] != ""
    assert services["encoder"]["ipc"] == "shareable" and services["pd"]["ipc"] == "service:encoder"
    assert services["pd"]["network_mode"] == "service:encoder"
    shm = services["encoder"]["shm_size"]
    assert shm.endswith("gb") and int(shm[:-2]) * 1024 > int(opts["encoder"]["--ring-mb"])
    # one uid everywhere (ring segments are 0600 and named after the uid)
    assert {svc["user"] for svc in services.values()} == {"10001:10001"}
    # keys: keygen writes the volume; everyone else mounts it read-only at --keys-dir
    assert argv["keygen"] == ["keygen", KEYS_DIR]
    for name, svc in services.items():
        mounts = [m for m in svc["volumes"] if m["target"] == KEYS_DIR]
        assert len(mounts) == 1 and mounts[0]["type"] == "volume" and mounts[0]["source"] == "keys", name
        assert mounts[0].get("read_only", False) is (name != "keygen"), name
        if name != "keygen":
            assert opts[name]["--keys-dir"] == KEYS_DIR
            assert services[name]["depends_on"]["keygen"]["condition"] == "service_completed_successfully"
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"], name
    # everyone talks to the broker's service name and port
    broker_port = opts["broker"]["--address"].rsplit(":", 1)[1]
    for name in ("encoder", "pd", "gateway"):
        assert opts[name]["--broker"] == f"tcp://broker:{broker_port}", name
    # health checks hit /health on the port that serves it
    metrics_port = opts["broker"]["--metrics"].rsplit(":", 1)[1]
    assert f"http://127.0.0.1:{metrics_port}/health" in " ".join(services["broker"]["healthcheck"]["test"])
    assert f"http://127.0.0.1:{opts['gateway']['--port']}/health" in " ".join(
        services["gateway"]["healthcheck"]["test"]
    )
    assert opts["gateway"]["--host"] == "0.0.0.0"


def test_compose_gpu_override_targets_pd():
    gpu = _load(DEPLOY / "compose.gpu.yaml")["services"]
    assert set(gpu) == {"pd"} and set(gpu) <= set(_load(DEPLOY / "compose.yaml")["services"])
    devices = gpu["pd"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["count"] == 1


def _gpu_pd(params: dict) -> None:
    """A PD worker on a GPU: vLLM, on the GPU named explicitly (not left to --device's cpu default)."""
    assert params["role"] == "pd" and params["engine"] == "auto" and params["device"] == "cuda:0"
    assert params["dtype"] == "auto"  # bf16 there (epdq.worker.devices.resolve_dtype)


def test_compose_gpu_override_runs_vllm_on_the_gpu():
    # the PD worker ran vLLM without --device: 'auto' dtype came from the cpu default, float32
    argv = compose_invocations(DEPLOY / "compose.gpu.yaml")["pd"]
    _gpu_pd(parse_epdq(argv))
    # Compose replaces the whole list: the override must be compose.yaml's command otherwise
    base = compose_invocations()["pd"]
    assert _options(argv) == _options(base) | {"--engine": "auto", "--device": "cuda:0"}
    assert argv[:3] == base[:3]


def test_systemd_pd_unit_names_its_device():
    sections = parse_unit((SYSTEMD / "epdq-pd@.service").read_text())
    env = _unit_env(sections)
    assert env["CUDA_VISIBLE_DEVICES"] == "%i" and env["EPDQ_PD_DEVICE"] == "cpu"  # starts on CPU-only hosts
    argv = unit_invocation(sections)
    assert _options(argv)["--device"] == "cpu"
    # what deploy/README.md tells a GPU host to set: the one GPU the instance sees
    gpu_argv = list(argv)
    gpu_argv[argv.index("--device") + 1] = "cuda:0"
    _gpu_pd(parse_epdq(gpu_argv))
    assert "`EPDQ_PD_DEVICE=cuda:0`" in (DEPLOY / "README.md").read_text()


_LONG_RUNNING = {"broker", "encoder", "pd", "gateway"}


def test_every_long_running_service_logs_json():
    """A JSON log pipeline must not get one service's lines as text (the gateway's were)."""
    argvs = {f"compose:{k}": v for k, v in compose_invocations().items() if k in _LONG_RUNNING}
    argvs |= {f"compose.gpu:{k}": v for k, v in compose_invocations(DEPLOY / "compose.gpu.yaml").items()}
    argvs |= {f"k8s:{k}": v for k, v in k8s_invocations().items()}
    argvs |= {f"systemd:{u}": unit_invocation(parse_unit((SYSTEMD / u).read_text())) for u in UNITS}
    assert len(argvs) == 4 + 1 + 4 + 4
    for key, argv in argvs.items():
        assert parse_epdq(argv)["log_format"] == "json", key


def _seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(s|m)?", str(value))
    assert m, value
    return int(m.group(1)) * (60 if m.group(2) == "m" else 1)


def test_stop_windows_outlast_the_graceful_shutdowns():
    """SIGTERM: the gateway lets open streams finish for GRACEFUL_SHUTDOWN_S (30 s), the broker and
    workers drain for --drain-timeout (30 s). The supervisor's window was shorter for the gateway
    (Docker 10 s, systemd 20 s, Kubernetes' default 30 s): it was killed mid-stream."""
    from epdq.gateway import GRACEFUL_SHUTDOWN_S

    longest = max(GRACEFUL_SHUTDOWN_S, 30.0) + 10  # room to start the stop and to exit
    services = _load(DEPLOY / "compose.yaml")["services"]
    for name in _LONG_RUNNING:
        assert _seconds(services[name]["stop_grace_period"]) >= longest, f"compose {name}"
    for unit in UNITS:
        service = dict(parse_unit((SYSTEMD / unit).read_text())["Service"])
        assert _seconds(service["TimeoutStopSec"]) >= longest, unit
    for name in ("epdq-broker", "epdq-worker", "epdq-gateway"):
        assert _pod(name)["terminationGracePeriodSeconds"] >= longest, name


# ================================================================== tests: wiring (Kubernetes)


def _pod(name: str) -> dict:
    return _find("Deployment", name)["spec"]["template"]["spec"]


def _container(pod: dict, name: str) -> dict:
    (c,) = [c for c in _containers(pod) if c["name"] == name]
    return c


def _mount(container: dict, path: str) -> dict:
    (m,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    return m


def _volume(pod: dict, name: str) -> dict:
    (v,) = [v for v in pod["volumes"] if v["name"] == name]
    return v


def test_k8s_worker_pod_shares_shm_and_node_id():
    pod = _pod("epdq-worker")
    enc, pd = _container(pod, "encoder"), _container(pod, "pd")
    assert [enc["args"][:3], pd["args"][:3]] == [["worker", "--role", "encoder"], ["worker", "--role", "pd"]]
    # one memory-backed emptyDir at /dev/shm in both, larger than the ring
    assert _mount(enc, "/dev/shm")["name"] == _mount(pd, "/dev/shm")["name"]
    shm = _volume(pod, _mount(enc, "/dev/shm")["name"])["emptyDir"]
    assert shm["medium"] == "Memory"
    assert shm["sizeLimit"].endswith("Gi") and int(shm["sizeLimit"][:-2]) * 1024 > int(
        _options(enc["args"])["--ring-mb"]
    )
    # the same node id: the same downward-API field in both containers
    nodes = []
    for c in (enc, pd):
        ref = re.fullmatch(r"\$\((\w+)\)", _options(c["args"])["--node"])
        assert ref, "--node must come from the pod (downward API)"
        (env,) = [e for e in c["env"] if e["name"] == ref.group(1)]
        nodes.append(env["valueFrom"]["fieldRef"]["fieldPath"])
    assert nodes == ["metadata.name", "metadata.name"]
    # one uid for both (set on the pod, not overridden per container)
    assert pod["securityContext"]["runAsUser"] == 10001
    assert all("runAsUser" not in c.get("securityContext", {}) for c in (enc, pd))
    # the fetch socket binds the pod IP, so PD workers in other pods can reach it
    fetch = re.fullmatch(r"tcp://\$\((\w+)\):(\d+)", _options(enc["args"])["--fetch-bind"])
    (ip_env,) = [e for e in enc["env"] if e["name"] == fetch.group(1)]
    assert ip_env["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert int(fetch.group(2)) in [p["containerPort"] for p in enc["ports"]]


def test_k8s_placeholders_are_defined():
    """Kubernetes leaves $(VAR) literally when VAR is not in the container's env: catch typos."""
    for name, doc in _k8s_docs():
        if doc["kind"] != "Deployment":
            continue
        for c in _containers(doc["spec"]["template"]["spec"]):
            defined = {e["name"] for e in c.get("env", [])}
            for arg in c.get("args", []) + c.get("command", []):
                for var in re.findall(r"(?<!\$)\$\((\w+)\)", arg):
                    assert var in defined, f"{name} {c['name']}: $({var}) is not defined"


# what each component needs in its keys dir (epdq.keys.security_for): own key pair, the broker's
# public key, and for CURVE servers (broker; encoder fetch sockets) the allow-list
NEEDED_KEYS = {
    "epdq-broker": {"broker.key", "broker.key_secret", "allowed/client.key", "allowed/worker.key"},
    "epdq-worker": {"worker.key", "worker.key_secret", "broker.key", "allowed/worker.key"},
    "epdq-gateway": {"client.key", "client.key_secret", "broker.key"},
}


@pytest.mark.parametrize("deployment", sorted(NEEDED_KEYS))
def test_k8s_curve_keys_from_secret(deployment: str):
    pod = _pod(deployment)
    secret_vols = [v for v in pod["volumes"] if "secret" in v]
    assert len(secret_vols) == 1
    secret = secret_vols[0]["secret"]
    assert secret["secretName"] == SECRET_NAME
    assert secret["defaultMode"] == 0o440
    assert {i["path"] for i in secret["items"]} == NEEDED_KEYS[deployment]
    assert all(i["key"] == i["path"].rsplit("/", 1)[-1] for i in secret["items"])  # keygen's file names
    # the init container copies them into a memory emptyDir as owner-only files ...
    (init,) = pod["initContainers"]
    script = init["command"][2]
    assert init["command"][:2] == ["/bin/sh", "-c"] and "umask 077" in script
    assert script == _pod("epdq-broker")["initContainers"][0]["command"][2], "init scripts diverged"
    src = _mount(init, "/run/epdq/curve-secret")
    assert src["name"] == secret_vols[0]["name"] and src["readOnly"] is True
    keys_vol = _mount(init, KEYS_DIR)["name"]
    assert _volume(pod, keys_vol)["emptyDir"]["medium"] == "Memory"
    # ... which every epdq container mounts read-only at its --keys-dir
    for c in pod["containers"]:
        assert _options(c["args"])["--keys-dir"] == KEYS_DIR
        m = _mount(c, KEYS_DIR)
        assert m["name"] == keys_vol and m["readOnly"] is True
        assert all(m["name"] != secret_vols[0]["name"] for m in c["volumeMounts"])


def test_k8s_init_script_copies_keys(tmp_path: Path):
    """Run the init container's script against a fake secret volume (symlinks, as kubelet makes)."""
    script = _pod("epdq-broker")["initContainers"][0]["command"][2]
    secret, keys = tmp_path / "secret", tmp_path / "keys"
    data = tmp_path / "secret-data"
    (data / "allowed").mkdir(parents=True)
    for rel in NEEDED_KEYS["epdq-broker"]:
        (data / rel).write_text(rel)
    secret.mkdir()
    (secret / "..data").symlink_to(data)
    for rel in ("broker.key", "broker.key_secret", "allowed"):
        (secret / rel).symlink_to(secret / "..data" / rel)
    keys.mkdir()
    script = script.replace("/run/epdq/curve-secret", str(secret)).replace(KEYS_DIR, str(keys))
    subprocess.run(["/bin/sh", "-c", script], check=True, timeout=30)
    copied = {str(p.relative_to(keys)) for p in keys.rglob("*") if p.is_file()}
    assert copied == NEEDED_KEYS["epdq-broker"]
    for rel in copied:
        p = keys / rel
        assert not p.is_symlink() and p.read_text() == rel and p.stat().st_mode & 0o777 == 0o600
    assert (keys / "allowed").stat().st_mode & 0o777 == 0o700


def test_k8s_probes_and_services():
    broker = _container(_pod("epdq-broker"), "broker")
    metrics_port = int(_options(broker["args"])["--metrics"].rsplit(":", 1)[1])
    zmq_port = int(_options(broker["args"])["--address"].rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in broker["ports"]}
    assert ports == {"zmq": zmq_port, "metrics": metrics_port}
    assert broker["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert broker["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    assert _find("Deployment", "epdq-broker")["spec"]["replicas"] == 1
    assert _find("Deployment", "epdq-broker")["spec"]["strategy"]["type"] == "Recreate"

    gateway = _container(_pod("epdq-gateway"), "gateway")
    http_port = int(_options(gateway["args"])["--port"])
    assert {p["name"]: p["containerPort"] for p in gateway["ports"]} == {"http": http_port}
    assert _options(gateway["args"])["--host"] == "0.0.0.0"
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"]["port"] == "http"

    svc = _find("Service", "epdq-broker")["spec"]
    assert svc["publishNotReadyAddresses"] is True  # workers must reach a broker that has none yet
    assert {p["name"]: p["port"] for p in svc["ports"]} == {"zmq": zmq_port, "metrics": metrics_port}
    for container in (*_pod("epdq-worker")["containers"], gateway):
        assert _options(container["args"])["--broker"] == f"tcp://epdq-broker:{zmq_port}"
    for name in ("epdq-broker", "epdq-gateway"):
        spec = _find("Service", name)["spec"]
        labels = _find("Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert spec["selector"].items() <= labels.items()
        named = {p["name"] for c in _pod(name)["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in spec["ports"]} <= named


@pytest.mark.parametrize("deployment", ["epdq-broker", "epdq-worker", "epdq-gateway"])
def test_k8s_security_and_resources(deployment: str):
    dep = _find("Deployment", deployment)
    pod = dep["spec"]["template"]["spec"]
    assert (
        dep["spec"]["selector"]["matchLabels"].items()
        <= dep["spec"]["template"]["metadata"]["labels"].items()
    )
    sc = pod["securityContext"]
    assert (
        sc["runAsNonRoot"] is True
        and sc["runAsUser"] == 10001
        and sc["seccompProfile"]["type"] == "RuntimeDefault"
    )
    assert pod["automountServiceAccountToken"] is False
    for c in _containers(pod):
        csc = c["securityContext"]
        assert csc["readOnlyRootFilesystem"] is True and csc["allowPrivilegeEscalation"] is False
        assert csc["capabilities"]["drop"] == ["ALL"]
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and {"cpu", "memory"} <= set(
            c["resources"]["limits"]
        )
        if c not in pod.get("initContainers", []):
            assert _mount(c, "/tmp")  # a writable /tmp (HOME) beside the read-only root


def _json_patch(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 add/replace, as kustomize applies them (enough for the README's patch)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] in ("add", "replace"), op
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target = doc
        for p in parents:
            target = target[int(p)] if isinstance(target, list) else target[p]
        if isinstance(target, list):
            if last == "-":
                target.append(op["value"])
            elif op["op"] == "add":
                target.insert(int(last), op["value"])
            else:
                target[int(last)] = op["value"]
        else:
            assert op["op"] == "add" or last in target, op
            target[last] = op["value"]
    return doc


def test_readme_gpu_patch_points_at_pd_engine():
    readme = (DEPLOY / "README.md").read_text()
    (block,) = re.findall(r"```yaml\n(.*?)```", readme, re.S)
    ops = yaml.safe_load(block)
    for op in ops:
        m = re.fullmatch(r"/spec/template/spec/containers/(\d+)/(.*)", op["path"])
        assert _pod("epdq-worker")["containers"][int(m.group(1))]["name"] == "pd"
        assert m.group(2) == "args/8" or m.group(2) in ("args/-", "resources/limits/nvidia.com~1gpu"), op
    patched = _json_patch(_find("Deployment", "epdq-worker"), ops)
    pd = _container(patched["spec"]["template"]["spec"], "pd")
    _gpu_pd(parse_epdq(pd["args"]))
    assert pd["resources"]["limits"]["nvidia.com/gpu"] == 1
