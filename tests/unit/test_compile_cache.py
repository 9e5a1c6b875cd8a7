"""TorchInductor's code cache: compiled code is written and loaded only where no other user can
write or replace (torch's default /tmp/torchinductor_<user> is used as found, whoever made it)."""

import os
import subprocess
import sys

import pytest

from vlrft.errors import ConfigError
from vlrft.models.compile_cache import (
    CACHE_VARIABLE,
    TRITON_VARIABLE,
    torch_default_cache,
    untrusted_reason,
    use_private_compile_cache,
)

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")


@pytest.fixture
def private_env(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    monkeypatch.setenv("HOME", str(home))
    for variable in (CACHE_VARIABLE, TRITON_VARIABLE, "TORCHINDUCTOR_CPP_WRAPPER"):
        monkeypatch.delenv(variable, raising=False)
    return tmp_path


def test_default_is_a_private_directory_under_the_users_cache(private_env):
    path = use_private_compile_cache()
    assert path == private_env / "home" / ".cache" / "vlrft" / "torchinductor"
    assert os.environ[CACHE_VARIABLE] == str(path) and oct(path.stat().st_mode & 0o777) == "0o700"
    assert use_private_compile_cache() == path  # the second call finds it as it left it


def test_torchs_own_default_in_the_variable_is_not_a_users_choice(private_env, monkeypatch):
    # Importing torch._dynamo writes /tmp/torchinductor_<user> into the variable: that is
    # torch's default, replaced by the private directory.
    monkeypatch.setenv(CACHE_VARIABLE, str(torch_default_cache()))
    assert use_private_compile_cache() == private_env / "home" / ".cache" / "vlrft" / "torchinductor"
    probe = "import os, torch._dynamo; print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))"
    env = {k: v for k, v in os.environ.items() if k != CACHE_VARIABLE}
    written = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300).stdout
    assert written.strip() in (str(torch_default_cache()), "None")  # what torch writes, if anything


def test_a_relative_xdg_cache_home_is_ignored(private_env, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert use_private_compile_cache() == private_env / "home" / ".cache" / "vlrft" / "torchinductor"


def test_a_directory_others_can_write_is_refused(private_env, monkeypatch):
    shared = private_env / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(CACHE_VARIABLE, str(shared))
    with pytest.raises(ConfigError, match=r"another user can write or replace: .*shared is writable by other users \(mode 777\)"):
        use_private_compile_cache()


@as_root
def test_a_directory_of_another_user_is_refused(private_env, monkeypatch):
    planted = private_env / "torchinductor_root"  # as a local user could make it in /tmp first
    planted.mkdir(mode=0o700)
    os.chown(planted, NOBODY, NOBODY)
    monkeypatch.setenv(CACHE_VARIABLE, str(planted))
    with pytest.raises(ConfigError, match=f"belongs to uid {NOBODY}, not to this user"):
        use_private_compile_cache()


@as_root
def test_a_link_anywhere_on_the_path_is_refused(private_env, monkeypatch):
    # A root-owned link in a sticky directory, pointing into another user's tree: the checked
    # path would stay, the directory behind it could be swapped (or the link re-pointed).
    users = private_env / "users_home"
    users.mkdir()
    os.chown(users, NOBODY, NOBODY)
    (users / "cache").mkdir(mode=0o755)
    sticky = private_env / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (sticky / "link").symlink_to(users / "cache")
    monkeypatch.setenv(CACHE_VARIABLE, str(sticky / "link" / "inductor"))
    with pytest.raises(ConfigError, match="has a symbolic link on its path"):
        use_private_compile_cache()
    assert "has a symbolic link on its path" in untrusted_reason(sticky / "link")


def test_replaceable_parents_and_triton_are_checked(private_env, monkeypatch):
    open_parent = private_env / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)  # no sticky bit: anyone may rename the directory away and put theirs
    (open_parent / "cache").mkdir(mode=0o700)
    assert "open is writable by other users (mode 777): it could replace" in untrusted_reason(open_parent / "cache")
    sticky = private_env / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # /tmp's mode: only the owner may remove or rename what is in it
    (sticky / "cache").mkdir(mode=0o700)
    assert untrusted_reason(sticky / "cache") == ""
    monkeypatch.setenv(TRITON_VARIABLE, str(open_parent / "cache"))
    with pytest.raises(ConfigError, match=f"set {TRITON_VARIABLE} to a directory of your own"):
        use_private_compile_cache()


def test_a_feature_that_reads_torchs_default_directory_needs_it_trusted(private_env, monkeypatch):
    monkeypatch.setattr("vlrft.models.compile_cache.torch_default_cache", lambda: private_env / "tmp_default")
    (private_env / "tmp_default").mkdir()
    (private_env / "tmp_default").chmod(0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CPP_WRAPPER", "1")
    with pytest.raises(ConfigError, match="TORCHINDUCTOR_CPP_WRAPPER read that directory"):
        use_private_compile_cache()
    monkeypatch.setenv("TORCHINDUCTOR_CPP_WRAPPER", "0")
    use_private_compile_cache()
