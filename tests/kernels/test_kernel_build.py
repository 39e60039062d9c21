"""The kernel build (codegen/build.py, codegen/sources.py, codegen/job.py): object keys follow
the sources a job is built from, done jobs are reused, a failed build leaves nothing behind,
and a checkout's library does not move with the model cache. The builds here are of tiny
fake families in a tmp codegen/ (one no-op function each), run through the real job runner."""
import json
import os
import shutil
import time

import pytest

from llambda.codegen import build, sources
from llambda.runtime import library
from repo_paths import REPO, TOOLS

# A family's kernel: what codegen/common.py's Kernel carries, without numpy or contract.py.
FAMILY_TEMPLATE = '''
from types import SimpleNamespace
from peachpy.x86_64 import Function, RETURN
{imports}

def kernel(name, isa):
    fn = Function(name, ())
    with fn:
        RETURN()
    return SimpleNamespace(function=fn, symbol=name, family="{family}", isa=isa, tile="", args=[])

def emit(isa, part=None):
    {body}
'''


def write_family(codegen, name, imports="", body=None):
    body = body or f'return [kernel("llb_{name}__" + isa, isa)]'
    (codegen / f"{name}.py").write_text(FAMILY_TEMPLATE.format(imports=imports, family=name, body=body))


@pytest.fixture
def codegen(tmp_path, monkeypatch):
    """A codegen/ of its own: shared.py, alpha (imports shared), beta, and the package gamma
    (imports shared, in two parts on avx2); the real job runner. build.HERE points at it."""
    here = tmp_path / "codegen"
    here.mkdir()
    (here / "__init__.py").write_text("")
    shutil.copy(build.HERE / "job.py", here / "job.py")
    (here / "shared.py").write_text("VALUE = 1\n")
    write_family(here, "alpha", imports="from .shared import VALUE")
    write_family(here, "beta")
    gamma = here / "gamma"
    gamma.mkdir()
    (gamma / "inner.py").write_text("from ..shared import VALUE\n")
    (gamma / "__init__.py").write_text(FAMILY_TEMPLATE.format(
        imports='from . import inner\nPARTS = {"avx2": ("one", "two")}', family="gamma",
        body='return [kernel(f"llb_gamma_{p}__" + isa, isa) for p in ((part,) if part else PARTS[isa])]'))
    monkeypatch.setattr(build, "HERE", here)
    monkeypatch.delenv("LLAMBDA_FAMILIES", raising=False)
    return here


@pytest.fixture
def job_runs(monkeypatch):
    """The labels of the jobs actually run, in the order they finish."""
    runs = []
    real = build._run_job

    def counted(job, objects):
        record = real(job, objects)
        runs.append(job.label)
        return record
    monkeypatch.setattr(build, "_run_job", counted)
    return runs


def keys(here):
    return {job.label: job.key for job in build.plan(("avx2",))}


def test_families_and_parts_are_read_without_importing(codegen):
    assert [f.name for f in sources.families(codegen)] == ["alpha", "beta", "gamma"]
    assert sources.closure(codegen, "gamma") == ["gamma", "shared"]
    assert sources.closure(codegen, "beta") == ["beta"]
    assert list(keys(codegen)) == ["alpha avx2", "beta avx2", "gamma avx2 one", "gamma avx2 two"]


def test_a_key_follows_its_own_sources_and_what_they_import(codegen):
    before = keys(codegen)
    (codegen / "shared.py").write_text("VALUE = 2\n")
    after_shared = keys(codegen)
    assert after_shared["beta avx2"] == before["beta avx2"]                 # does not import it
    for label in ("alpha avx2", "gamma avx2 one", "gamma avx2 two"):
        assert after_shared[label] != before[label]
    (codegen / "gamma" / "inner.py").write_text("from ..shared import VALUE  # edited\n")
    after_inner = keys(codegen)
    assert after_inner["gamma avx2 one"] != after_shared["gamma avx2 one"]
    assert after_inner["alpha avx2"] == after_shared["alpha avx2"]
    assert len(set(after_inner.values())) == len(after_inner)              # parts and ISAs apart


def test_the_library_key_needs_no_peachpy_and_covers_packages(codegen):
    before = build.source_key(peachpy="9.9")
    (codegen / "gamma" / "inner.py").write_text("# edited\n")
    assert build.source_key(peachpy="9.9") != before


def test_done_jobs_are_reused_and_a_failed_build_resumes(codegen, tmp_path, job_runs):
    objects = tmp_path / "objects"
    manifest = build.build(tmp_path / "lib1", isas=("avx2",), objects=objects, jobs=2)
    assert [k["symbol"] for k in manifest] == ["llb_alpha__avx2", "llb_beta__avx2",
                                                "llb_gamma_one__avx2", "llb_gamma_two__avx2"]
    assert sorted(job_runs) == ["alpha avx2", "beta avx2", "gamma avx2 one", "gamma avx2 two"]
    assert json.loads((tmp_path / "lib1" / build.MANIFEST_NAME).read_text()) == manifest

    job_runs.clear()
    build.build(tmp_path / "lib2", isas=("avx2",), objects=objects)
    assert job_runs == []                                  # every object reused

    # beta breaks: the build fails, alpha's new object is kept, and once beta is mended
    # only beta is built again
    write_family(codegen, "alpha", imports="from .shared import VALUE  # edited")
    write_family(codegen, "beta", body='raise RuntimeError("beta is broken")')
    with pytest.raises(RuntimeError, match="beta avx2 failed"):
        build.build(tmp_path / "lib3", isas=("avx2",), objects=objects, jobs=2)
    assert "alpha avx2" in job_runs                        # ran beside beta, and finished
    job_runs.clear()
    write_family(codegen, "beta", imports="# mended")
    build.build(tmp_path / "lib3", isas=("avx2",), objects=objects)
    assert job_runs == ["beta avx2"]


def test_a_failed_build_leaves_no_temporary_files(codegen, tmp_path):
    write_family(codegen, "beta", body='raise RuntimeError("beta is broken")')
    (tmp_path / "out").mkdir()
    with pytest.raises(RuntimeError, match="beta is broken"):
        build.build(tmp_path / "out" / "lib", isas=("avx2",), objects=tmp_path / "objects")
    assert list((tmp_path / "out").iterdir()) == []
    assert not list((tmp_path / "objects").glob("*.tmp")) and not list((tmp_path / "objects").glob("beta*"))


def test_old_objects_are_pruned_per_job(tmp_path):
    for i in range(5):
        for suffix in (".o", ".json"):
            path = tmp_path / f"alpha-avx2-{i:016x}{suffix}"
            path.write_text("{}")
            os.utime(path, (1000 + i, 1000 + i))
    (tmp_path / "beta-avx2-0000000000000000.json").write_text("{}")
    build.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("*.json")) == [
        "alpha-avx2-0000000000000003.json", "alpha-avx2-0000000000000004.json", "beta-avx2-0000000000000000.json"]
    assert not (tmp_path / "alpha-avx2-0000000000000000.o").exists()


def test_a_checkout_library_does_not_move_with_the_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMBDA_KERNEL_DIR", raising=False)
    assert library.checkout_dir() == REPO
    dirs = []
    for cache in ("one", "two"):
        monkeypatch.setenv("LLAMBDA_CACHE_DIR", str(tmp_path / cache))
        dirs.append(library.library_dir())
    assert dirs[0] == dirs[1] and dirs[0].parent == REPO / "build" / "kernels"
    assert library.objects_dir() == REPO / "build" / "kernels" / "objects"
    monkeypatch.setattr(library, "checkout_dir", lambda: None)             # an installed llambda
    assert library.library_dir().parent == tmp_path / "two" / "kernels"


def test_old_libraries_are_pruned_but_never_the_current(tmp_path):
    now = time.time()
    names = [f"{i:016x}" for i in range(6)]
    for age, name in enumerate(names):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (now - age, now - age))
    (tmp_path / "objects").mkdir()
    (tmp_path / ".build-old").mkdir()
    os.utime(tmp_path / ".build-old", (now - 7200, now - 7200))
    (tmp_path / ".build-running").mkdir()
    current = tmp_path / names[-1]                          # the oldest: kept all the same
    library.prune_libraries(tmp_path, current)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([".build-running", "objects", names[-1]] + names[:library.KEEP_LIBRARIES])


def test_a_real_family_builds_and_loads(tmp_path, monkeypatch):
    # the job runner on the real generators: the smallest family, both ISAs
    monkeypatch.setenv("LLAMBDA_FAMILIES", "probe")
    manifest = build.build(tmp_path / "lib", objects=tmp_path / "objects")
    assert {k["isa"] for k in manifest} == {"avx2", "avx512"} and all(k["code_bytes"] > 0 for k in manifest)
    lib = library.KernelLibrary(tmp_path / "lib")
    assert set(lib.manifest) == {k["symbol"] for k in manifest}


@pytest.mark.parametrize("jobs", ["0", "-1", "two"])
def test_regen_refuses_a_jobs_count_that_is_no_positive_number(jobs, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import regen
    with pytest.raises(SystemExit) as exit_:
        regen.main(["--jobs", jobs])
    assert exit_.value.code == 2
    assert f"--jobs: {jobs!r} is not a whole number >= 1" in capsys.readouterr().err
