"""skypilot/*.yaml parse with SkyPilot's own loader, offline (no cloud, no credentials). SkyPilot lives
in a venv of its own (bash .ci/skypilot.sh: skypilot==0.14.1, pyyaml, pytest), never in the main one;
there this whole file is skipped, visibly. The wiring itself is tested in test_skypilot.py."""
import glob
import os

import pytest

dag_utils = pytest.importorskip("sky.utils.dag_utils", reason="SkyPilot's parser runs in its own venv: "
                                                             "bash .ci/skypilot.sh (skypilot==0.14.1)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(ROOT, "skypilot", "*.yaml")))
JOBGROUP = os.path.join(ROOT, "skypilot", "countdown_jobgroup.yaml")
# 0.14.1 only warns about other header keys ("will be ignored"), so a typo there would pass the loader.
HEADER_KEYS = {"name", "execution", "primary_tasks", "termination_delay", "inter_connection"}


@pytest.fixture(autouse=True)
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # workdir: . means the directory `sky launch` runs in: the repository root


def load(path, **kw):
    return dag_utils.load_dag_from_yaml(path, **kw)


def test_the_four_launch_files_are_there():
    assert sorted(map(os.path.basename, FILES)) == ["countdown.yaml", "countdown_jobgroup.yaml",
                                                     "gsm8k_1gpu.yaml", "gsm8k_2gpu_async.yaml"]


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_parses_and_the_token_comes_only_from_secret(path):
    dag = load(path)
    for task in dag.tasks:
        assert task.run and task.setup and task.workdir == "."
        assert "NANORL_TOKEN" not in task.envs
        if "--role" in task.run:        # async: declared as a secret with no value, filled by --secret
            assert [r.name for r in task.managed_secret_refs] == ["NANORL_TOKEN"] and not task.secrets
    for task in load(path, secrets_overrides=[("NANORL_TOKEN", "from-the-shell")]).tasks:
        if "--role" in task.run:        # what `--secret NANORL_TOKEN` does with the shell's value
            assert task.secrets["NANORL_TOKEN"].get_secret_value() == "from-the-shell"


def test_countdown_is_one_task_of_identical_gpu_nodes():
    dag = load(os.path.join(ROOT, "skypilot", "countdown.yaml"))
    assert not dag.is_job_group() and len(dag.tasks) == 1
    task = dag.tasks[0]
    assert task.num_nodes == 2 and [r.accelerators for r in task.resources] == [{"H100": 8}]


def test_jobgroup_is_a_parallel_group_of_an_h100_trainer_and_l40s_workers():
    dag = load(JOBGROUP)
    assert dag.is_job_group() and dag.primary_tasks == ["trainer"]
    tasks = {t.name: t for t in dag.tasks}
    assert [r.accelerators for r in tasks["trainer"].resources] == [{"H100": 8}]
    assert [r.accelerators for r in tasks["workers"].resources] == [{"L40S": 1}]
    assert "trainer-0.$SKYPILOT_JOBGROUP_NAME" in tasks["workers"].run
    import yaml
    header = next(yaml.safe_load_all(open(JOBGROUP)))
    assert set(header) <= HEADER_KEYS, f"the loader ignores unknown header keys: {set(header) - HEADER_KEYS}"


def test_the_loader_rejects_a_misspelt_key(tmp_path):
    """The parse test can fail: the same file with one key misspelt is refused."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(open(os.path.join(ROOT, "skypilot", "countdown.yaml")).read().replace("\nenvs:", "\nenvz:"))
    with pytest.raises(Exception, match="envz"):
        load(str(bad))
