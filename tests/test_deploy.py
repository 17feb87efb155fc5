"""deploy/: the SLURM batch script and the Kubernetes manifests build the `join-swarm` and `hivetrain coordinator`
command lines that the CLIs accept.

The sbatch script runs here as plain bash with the SLURM variables set by hand and `srun`, `scontrol`, `hostname` and
`join-swarm` replaced by stubs on PATH that record their argv. The CLIs' flags are read from their source with `ast`
(importing them pulls in torch and hivemind, seconds per test run).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from hivetrain.cli import args

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SBATCH = DEPLOY / "slurm" / "join-swarm.sbatch"
K8S = DEPLOY / "kubernetes"
COORDINATOR_YAML = K8S / "coordinator" / "coordinator.yaml"
VOLUNTEERS_YAML = K8S / "volunteers" / "join-swarm-job.yaml"
ADDR = "/ip4/203.0.113.5/tcp/31337/p2p/QmCoordinator"
ADDR2 = "/ip4/198.51.100.9/tcp/4001/p2p/QmOtherPeer"

# --- the CLIs' flags, from their real parsers (``hivetrain.cli.args``: importable without torch) ------------------


def cli_options(command: str) -> dict[str, dict]:
    """The options of ``join-swarm`` or ``hivetrain coordinator``: flag -> its action ("store_true" for flags without a
    value), nargs and choices, with ``hidden`` set for flags whose help is ``argparse.SUPPRESS`` (test harness only)."""
    parser = {"join-swarm": args.join_swarm_parser, "coordinator": args.coordinator_parser}[command]()
    options = {}
    for action in parser._actions:
        spec: dict = {"hidden": action.help == argparse.SUPPRESS}
        if action.nargs == 0:
            spec["action"] = "store_true"
        elif action.nargs is not None:
            spec["nargs"] = action.nargs
        if action.choices is not None:
            spec["choices"] = list(action.choices)
        for name in action.option_strings:
            options[name] = spec
    return options


def exit_codes() -> dict[str, int]:
    """join-swarm's exit codes (``EXIT_OK, EXIT_BAD_INPUT, ... = 0, 2, ...`` in hivetrain/cli/common.py)."""
    for node in ast.parse((ROOT / "hivetrain" / "cli" / "common.py").read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple):
            names = [t.id for t in node.targets[0].elts]
            if "EXIT_BAD_INPUT" in names:
                return dict(zip(names, ast.literal_eval(node.value), strict=True))
    raise AssertionError("no EXIT_* codes in hivetrain/cli/common.py")


def check_argv(argv: list[str], options: dict[str, dict]) -> dict[str, list[str]]:
    """Walk ``argv`` as argparse would: leading positionals are addresses, every flag must be a visible option of the
    CLI, with a value where it takes one and a value among its choices. Returns flag -> values (last one wins)."""
    i, parsed = 0, {}
    while i < len(argv) and not argv[i].startswith("-"):
        assert argv[i].startswith("/ip4/") and "/p2p/" in argv[i], f"positional {argv[i]!r} is not a multiaddr"
        i += 1
    while i < len(argv):
        flag = argv[i]
        assert flag in options, f"{flag} is not an option of the CLI (known: {sorted(options)})"
        spec = options[flag]
        assert not spec["hidden"], f"{flag} is a test-harness flag"
        i += 1
        if spec.get("action") == "store_true":
            values = []
        elif spec.get("nargs") in ("+", "*"):
            values = []
            while i < len(argv) and not argv[i].startswith("-"):
                values.append(argv[i])
                i += 1
            assert values or spec["nargs"] == "*", f"{flag} needs a value"
        else:
            assert i < len(argv) and not argv[i].startswith("--"), f"{flag} needs a value"
            values = [argv[i]]
            i += 1
        if "choices" in spec:
            assert values[0] in spec["choices"], f"{flag} {values[0]}: not one of {spec['choices']}"
        parsed[flag] = values
    return parsed


# --- stubs --------------------------------------------------------------------------------------------------------

SRUN_STUB = r"""#!/usr/bin/env bash
# srun for tests: records its argv (call N in srun-argv-N), runs the command once per node (SLURM_PROCID = 0..N-1)
# and exits with the tasks' highest status.
calls=("$STUB_OUT"/srun-argv-*)
[[ -e "${calls[0]}" ]] || calls=()
printf '%s\0' "$@" > "$STUB_OUT/srun-argv-${#calls[@]}"
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
  SLURM_PROCID=$i SLURM_NODEID=$i "$@" &
  pids+=("$!")
done
status=0
for pid in "${pids[@]}"; do
  while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done
  wait "$pid"; s=$?
  if ((s > status)); then status=$s; fi
done
exit "$status"
"""

# join-swarm for tests: records its argv; with STUB_WAIT=1 it runs until SIGTERM, counts each SIGTERM in term-I (a
# second one would make the real join-swarm exit without leaving), and exits 130 as join-swarm does.
JOIN_SWARM_STUB = r"""#!/usr/bin/env bash
i="${SLURM_PROCID:-${PEER_INDEX:?}}"
printf '%s\0' "$@" > "$STUB_OUT/argv-$i"
if [[ "${STUB_WAIT:-0}" == 1 ]]; then
  left=-1
  trap 'echo term >> "$STUB_OUT/term-$i"; left=6' TERM
  echo $$ > "$STUB_OUT/pid-$i"
  touch "$STUB_OUT/ready-$i"
  while ((left != 0)); do sleep 0.05; if ((left > 0)); then left=$((left - 1)); fi; done
  exit 130
fi
exit "${STUB_EXIT:-0}"
"""

SCONTROL_STUB = '#!/usr/bin/env bash\nprintf \'%s\\0\' "$@" > "$STUB_OUT/scontrol-argv"\n'
SCANCEL_STUB = '#!/usr/bin/env bash\nprintf \'%s\\0\' "$@" > "$STUB_OUT/scancel-argv"\n'
HOSTNAME_STUB = '#!/usr/bin/env bash\nif [[ "${1:-}" == -I ]]; then echo "198.51.100.7 10.1.2.3 "; else echo node; fi\n'


def read_argv(path: Path) -> list[str]:
    return path.read_bytes().decode().split("\0")[:-1]


@pytest.fixture
def slurm(tmp_path):
    """Stubs on PATH, the SLURM variables of a 2-node job, and ``run(*args, **env)`` of the batch script."""
    stubs, out, home = tmp_path / "bin", tmp_path / "out", tmp_path / "home"
    for d in (stubs, out, home):
        d.mkdir()
    for name, text in [
        ("srun", SRUN_STUB),
        ("join-swarm", JOIN_SWARM_STUB),
        ("scontrol", SCONTROL_STUB),
        ("scancel", SCANCEL_STUB),
        ("hostname", HOSTNAME_STUB),
    ]:
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    base = {
        "PATH": f"{stubs}:/usr/bin:/bin",
        "HOME": str(home),
        "STUB_OUT": str(out),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "hivetrain",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_CPUS_PER_TASK": "8",
    }

    class Slurm:
        def __init__(self):
            self.out, self.home, self.env = out, home, base

        def popen(self, *args: str, **env: str) -> subprocess.Popen:
            return subprocess.Popen(
                ["bash", str(SBATCH), *args],
                env={**base, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )

        def run(self, *args: str, **env: str) -> subprocess.CompletedProcess:
            proc = self.popen(*args, **env)
            stdout, stderr = proc.communicate(timeout=30)
            return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

        def wait_ready(self, num_peers: int = 2, timeout_s: float = 10.0) -> None:
            deadline = time.monotonic() + timeout_s
            while not all((out / f"ready-{i}").exists() for i in range(num_peers)):
                assert time.monotonic() < deadline, "the stub peers did not start"
                time.sleep(0.01)

    return Slurm()


def peer_argv(state: Path, i: int, *tail: str) -> list[str]:
    peer = state / f"peer-{i}"
    return [
        "--identity-path",
        f"{peer}/identity.key",
        "--summary-file",
        f"{peer}/summary.json",
        "--metrics-file",
        f"{peer}/metrics.jsonl",
        *tail,
    ]


# --- SLURM --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sbatch_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr
    assert os.access(SBATCH, os.X_OK)


@pytest.mark.slow
def test_sbatch_runs_one_peer_per_node_with_its_own_identity(slurm):
    result = slurm.run(ADDR, ADDR2, "--duty-cycle", "0.5")
    assert result.returncode == 0, result.stderr
    state = slurm.home / ".hivetrain" / "slurm-hivetrain"  # the default HIVETRAIN_STATE_DIR
    assert read_argv(slurm.out / "srun-argv-0") == [
        "--export=ALL",
        "--kill-on-bad-exit=0",
        "--cpus-per-task=8",
        "bash",
        "-c",
        'hivetrain_peer "$@"',
        "hivetrain-peer",
        ADDR,
        ADDR2,
        "--duty-cycle",
        "0.5",
    ]
    options = cli_options("join-swarm")
    for i in range(2):
        argv = read_argv(slurm.out / f"argv-{i}")
        tail = ("--device", "auto", "--threads", "8", "--client-mode", "--duty-cycle", "0.5")
        assert argv == [ADDR, ADDR2, *peer_argv(state, i, *tail)]
        check_argv(argv, options)
        assert (state / f"peer-{i}").is_dir()
    assert not (slurm.out / "scontrol-argv").exists()


@pytest.mark.slow
def test_sbatch_public_nodes_announce_their_address_and_invited_peers_pass_their_token(slurm, tmp_path):
    state = tmp_path / "state"
    (state / "peer-1").mkdir(parents=True)
    (state / "peer-1" / "join-token").write_text("token-of-peer-1\n")
    result = slurm.run(
        HIVETRAIN_ADDRESS=f"{ADDR} {ADDR2}",
        HIVETRAIN_STATE_DIR=str(state),
        HIVETRAIN_NETWORK="public",
        HIVETRAIN_PORT="4100",
        HIVETRAIN_DEVICE="cuda",
        HIVETRAIN_PUBLIC_NAME="mylab",
    )
    assert result.returncode == 0, result.stderr
    options = cli_options("join-swarm")
    for i in range(2):
        argv = read_argv(slurm.out / f"argv-{i}")
        token = ["--join-token", f"@{state}/peer-1/join-token"] if i == 1 else []
        network = ["--host-maddrs", "/ip4/0.0.0.0/tcp/4100", "--announce-maddrs", "/ip4/198.51.100.7/tcp/4100"]
        tail = ("--device", "cuda", "--threads", "8", "--public-name", f"mylab-{i}", *token, *network)
        assert argv == [ADDR, ADDR2, *peer_argv(state, i, *tail)]
        assert check_argv(argv, options)["--announce-maddrs"] == ["/ip4/198.51.100.7/tcp/4100"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, requeue, message",
    [(signal.SIGUSR1, True, "time limit near"), (signal.SIGUSR2, False, "asked to leave")],
)
def test_sbatch_signal_makes_each_join_swarm_leave_once(slurm, sig, requeue, message):
    proc = slurm.popen(ADDR, STUB_WAIT="1")
    try:
        slurm.wait_ready()
        proc.send_signal(sig)  # USR1: --signal=B:USR1@180 before the time limit; USR2: scancel --batch --signal=USR2
        _, stderr = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    for i in range(2):  # exactly one SIGTERM: a second one makes join-swarm exit without leaving
        assert (slurm.out / f"term-{i}").read_text() == "term\n"
    # a second step on every node signals join-swarm's own PID (what the peer's wrapper recorded before exec)
    assert read_argv(slurm.out / "srun-argv-1") == [
        "--overlap",
        "--export=ALL",
        "--kill-on-bad-exit=0",
        "--cpus-per-task=8",
        "bash",
        "-c",
        "hivetrain_leave",
    ]
    assert not (slurm.out / "scancel-argv").exists()
    if requeue:
        assert read_argv(slurm.out / "scontrol-argv") == ["requeue", "4242"]
    else:
        assert not (slurm.out / "scontrol-argv").exists()
    assert message in stderr


@pytest.mark.slow
def test_sbatch_cancel_leaves_signalling_the_peers_to_slurm(slurm):
    proc = slurm.popen(ADDR, STUB_WAIT="1")
    try:
        slurm.wait_ready()
        proc.send_signal(signal.SIGTERM)  # scancel: SLURM signals the batch shell and every task itself
        time.sleep(0.3)
        assert proc.poll() is None, "the batch shell must wait for its peers"
        assert not list(slurm.out.glob("term-*")), "the batch shell must not send the peers a second SIGTERM"
        for i in range(2):
            os.kill(int((slurm.out / f"pid-{i}").read_text()), signal.SIGTERM)
        _, stderr = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == exit_codes()["EXIT_INTERRUPTED"], stderr
    assert not (slurm.out / "scontrol-argv").exists() and not (slurm.out / "scancel-argv").exists()


@pytest.mark.slow
def test_sbatch_exits_with_the_peers_status_without_requeueing(slurm):
    result = slurm.run(ADDR, STUB_EXIT=str(exit_codes()["EXIT_INCOMPATIBLE"]))
    assert result.returncode == exit_codes()["EXIT_INCOMPATIBLE"]
    assert not (slurm.out / "scontrol-argv").exists()


@pytest.mark.parametrize(
    "args, env, message",
    [
        ((), {}, "give the run's address"),
        (("--public-name", "x"), {}, "give the run's address"),
        ((ADDR,), {"HIVETRAIN_NETWORK": "lan"}, "HIVETRAIN_NETWORK=lan"),
        ((ADDR,), {"HIVETRAIN_NETWORK": "public", "HIVETRAIN_PORT": "0"}, "HIVETRAIN_PORT=0"),  # announced: not 0
        ((ADDR,), {"HIVETRAIN_JOIN_SWARM": "/nonexistent/join-swarm"}, "/nonexistent/join-swarm not found"),
    ],
)
@pytest.mark.slow
def test_sbatch_refuses_bad_settings_before_starting_peers(slurm, args, env, message):
    result = slurm.run(*args, **env)
    assert result.returncode == exit_codes()["EXIT_BAD_INPUT"]
    assert message in result.stderr
    assert not list(slurm.out.glob("srun-argv-*"))


# --- Kubernetes ---------------------------------------------------------------------------------------------------


def load_docs(path: Path) -> dict[str, dict]:
    """The YAML documents of ``path`` by ``Kind/name``, each checked for the fields every object needs."""
    docs = {}
    for doc in yaml.safe_load_all(path.read_text()):
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), f"{path}: {doc}"
        docs[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return docs


def generated_config_maps(kustomization: Path) -> dict[str, dict]:
    """configMapGenerator entries of a kustomization: name -> {key: value or file name}."""
    maps = {}
    for gen in yaml.safe_load(kustomization.read_text())["configMapGenerator"]:
        entries = dict(line.split("=", 1) for line in gen.get("literals", []))
        entries.update({name: name for name in gen.get("files", [])})
        maps[gen["name"]] = entries
    return maps


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def check_pod_references(spec: dict, config_maps: dict[str, dict], secrets_doc: str) -> None:
    """Mounts name volumes; ConfigMaps come from the kustomization; Secrets are the ones the README creates."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    for container in spec.get("initContainers", []) + spec["containers"]:
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, f"{container['name']} mounts unknown volume {mount['name']}"
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                assert ref["key"] in config_maps[ref["name"]], f"{ref} is not in the kustomization"
        for source in container.get("envFrom", []):
            assert source["configMapRef"]["name"] in config_maps
    for volume in volumes.values():
        if "configMap" in volume:
            assert volume["configMap"]["name"] in config_maps
        if "secret" in volume:
            name = volume["secret"]["secretName"]
            assert f"kubectl create secret generic {name}" in secrets_doc, f"deploy/kubernetes/README.md: {name}"
            assert volume["secret"]["defaultMode"] == 0o440  # readable by fsGroup only, copied to 0400 by the pod


def run_pod_script(script: str, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run a container's ``sh -c`` script with its absolute paths moved under ``tmp_path`` and stubs on PATH."""
    script = script.replace("/var/lib/hivetrain", str(tmp_path / "work")).replace("/secrets", str(tmp_path / "secrets"))
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / "join-swarm").write_text(JOIN_SWARM_STUB)
    (stubs / "join-swarm").chmod(0o755)
    (tmp_path / "work").mkdir(exist_ok=True)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "STUB_OUT": str(tmp_path), **env}
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=10)


def test_coordinator_manifests_agree_with_the_coordinator_cli():
    docs = load_docs(COORDINATOR_YAML)
    assert set(docs) == {
        "PersistentVolumeClaim/hivetrain-coordinator",
        "Deployment/hivetrain-coordinator",
        "Service/hivetrain-coordinator-p2p",
        "Service/hivetrain-coordinator-dashboard",
    }
    deployment = docs["Deployment/hivetrain-coordinator"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    spec = pod_spec(deployment)
    config_maps = generated_config_maps(K8S / "coordinator" / "kustomization.yaml")
    check_pod_references(spec, config_maps, (K8S / "README.md").read_text())
    assert spec["volumes"][0]["persistentVolumeClaim"]["claimName"] in {d.split("/")[1] for d in docs}

    (container,) = spec["containers"]
    assert container["args"][:2] == ["hivetrain", "coordinator"]
    env_names = {e["name"] for e in container["env"]}
    argv = [
        re.sub(r"\$\((\w+)\)", lambda m: "198.51.100.1" if m[1] in env_names else m[0], a) for a in container["args"]
    ]
    flags = check_argv(argv[2:], cli_options("coordinator"))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    p2p_port = ports["p2p"]
    assert flags["--host-maddrs"] == [f"/ip4/0.0.0.0/tcp/{p2p_port}"]
    assert flags["--announce-maddrs"] == [f"/ip4/198.51.100.1/tcp/{p2p_port}"]
    assert int(flags["--http-port"][0]) == ports["http"]
    assert flags["--http-host"] == ["0.0.0.0"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert (
        flags["--config"] == [f"{mounts['run-config']}/run.toml"] and "run.toml" in config_maps["hivetrain-run-config"]
    )
    for flag in ("--identity-path", "--checkpoint-dir", "--address-file"):
        assert flags[flag][0].startswith(mounts["state"] + "/"), f"{flag} must be on the volume"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}

    for name, port in [("p2p", p2p_port), ("dashboard", ports["http"])]:
        service = docs[f"Service/hivetrain-coordinator-{name}"]
        assert service["spec"]["selector"].items() <= labels.items()
        (service_port,) = service["spec"]["ports"]
        assert service_port["port"] == port and service_port["targetPort"] in ports
    assert docs["Service/hivetrain-coordinator-p2p"]["spec"]["type"] == "LoadBalancer"
    dashboard = docs["Service/hivetrain-coordinator-dashboard"]["metadata"]["annotations"]
    assert dashboard["prometheus.io/port"] == str(ports["http"]) and dashboard["prometheus.io/path"] == "/metrics"


@pytest.mark.slow
def test_coordinator_init_container_installs_the_identity_key_from_the_secret(tmp_path):
    spec = pod_spec(load_docs(COORDINATOR_YAML)["Deployment/hivetrain-coordinator"])
    (init,) = spec["initContainers"]
    assert init["args"][:2] == ["sh", "-c"]
    key = tmp_path / "work" / "coordinator.key"
    assert run_pod_script(init["args"][2], tmp_path, {}).returncode == 0 and not key.exists()  # no Secret: no key
    (tmp_path / "secrets" / "identity").mkdir(parents=True)
    (tmp_path / "secrets" / "identity" / "identity.key").write_bytes(b"key-1")
    for content in (b"key-1", b"key-2"):  # a second start replaces the 0400 copy with the Secret's (rotated) key
        (tmp_path / "secrets" / "identity" / "identity.key").write_bytes(content)
        result = run_pod_script(init["args"][2], tmp_path, {})
        assert result.returncode == 0, result.stderr
        assert key.read_bytes() == content and key.stat().st_mode & 0o777 == 0o400


def test_coordinator_run_config_is_valid():
    from hivetrain.config import load_run_config

    config = load_run_config(K8S / "coordinator" / "run.toml")
    assert config.run_id and config.model


@pytest.mark.slow
def test_volunteer_job_runs_one_join_swarm_per_index(tmp_path):
    docs = load_docs(VOLUNTEERS_YAML)
    job = docs["Job/hivetrain-volunteers"]
    assert set(docs) == {"Job/hivetrain-volunteers"}
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["parallelism"] == job["spec"]["completions"]
    spec = pod_spec(job)
    assert spec["restartPolicy"] == "Never"  # required by podFailurePolicy
    config_maps = generated_config_maps(K8S / "volunteers" / "kustomization.yaml")
    check_pod_references(spec, config_maps, (K8S / "README.md").read_text())
    (container,) = spec["containers"]
    codes = exit_codes()
    fail_index = job["spec"]["podFailurePolicy"]["rules"][0]
    assert fail_index["action"] == "FailIndex" and fail_index["onExitCodes"]["containerName"] == container["name"]
    assert fail_index["onExitCodes"]["values"] == [codes["EXIT_BAD_INPUT"], codes["EXIT_INCOMPATIBLE"]]
    index_env = {e["name"]: e["valueFrom"] for e in container["env"]}
    assert index_env["PEER_INDEX"]["fieldRef"]["fieldPath"].endswith("['batch.kubernetes.io/job-completion-index']")
    assert index_env["CPU_LIMIT"]["resourceFieldRef"]["resource"] == "limits.cpu"

    # The pod's script, run for peer 0 (no Secrets) and peer 1 (identity and join token in the Secrets).
    secrets = tmp_path / "secrets"
    (secrets / "identities").mkdir(parents=True)
    (secrets / "join-tokens").mkdir()
    (secrets / "identities" / "identity-1.key").write_bytes(b"peer-1-key")
    (secrets / "join-tokens" / "token-1").write_text("token-of-peer-1\n")
    settings = config_maps["hivetrain-volunteer-settings"]
    assert set(settings) == {"HIVETRAIN_ADDRESS", "HIVETRAIN_PUBLIC_NAME", "HIVETRAIN_EXTRA_ARGS"}
    env = {"CPU_LIMIT": "8", "HIVETRAIN_ADDRESS": f"{ADDR} {ADDR2}", "HIVETRAIN_PUBLIC_NAME": "mylab"}
    env["HIVETRAIN_EXTRA_ARGS"] = "--duty-cycle 0.5"
    assert container["args"][:2] == ["sh", "-c"]
    work = tmp_path / "work"
    options = cli_options("join-swarm")
    for i in range(2):
        result = run_pod_script(container["args"][2], tmp_path, {**env, "PEER_INDEX": str(i)})
        assert result.returncode == 0, result.stderr
        argv = read_argv(tmp_path / f"argv-{i}")
        token = ["--join-token", f"@{secrets}/join-tokens/token-1"] if i == 1 else []
        assert argv == [
            ADDR,
            ADDR2,
            "--identity-path",
            f"{work}/identity.key",
            "--summary-file",
            f"{work}/summary.json",
            "--metrics-file",
            f"{work}/metrics.jsonl",
            "--device",
            "auto",
            "--threads",
            "8",
            "--client-mode",
            "--public-name",
            f"mylab-{i}",
            *token,
            "--duty-cycle",
            "0.5",
        ]
        check_argv(argv, options)
        if i == 0:
            assert not (work / "identity.key").exists()  # join-swarm creates a fresh one
    assert (work / "identity.key").read_bytes() == b"peer-1-key"
    assert (work / "identity.key").stat().st_mode & 0o777 == 0o400


def test_dockerfile_installs_the_torch_version_of_the_setup_script():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    setup = (ROOT / "scripts" / "_setup.sh").read_text()
    setup_version = re.search(r'HIVETRAIN_TORCH_VERSION:-([0-9.]+)}"', setup)[1]
    assert f"ARG TORCH_VERSION={setup_version}\n" in dockerfile
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu\n" in dockerfile
    copied = re.findall(r"^COPY (.+) \S+$", dockerfile, flags=re.M)
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for path in " ".join(copied).split():  # everything the image copies is in the build context
        assert f"!{path}" in ignore or f"!{path}/" in ignore, path
