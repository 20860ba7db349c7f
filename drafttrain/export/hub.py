"""Upload an exported folder to the Hugging Face Hub with `huggingface_hub`.

The token comes from the argument, else `HF_TOKEN` / `HUGGING_FACE_HUB_TOKEN`, else the stored
login (`hf auth login`). The folder goes up as ONE commit (`HfApi.upload_folder`), so a failed
upload leaves no partial set of files; at worst an empty repo from `create_repo` remains.

What it does not do: retry, resume large uploads, or write the token anywhere (every message is
scrubbed). `--dry-run` is handled by the caller: it writes the folder and never calls this.
"""

from __future__ import annotations

import os
from pathlib import Path

from drafttrain.errors import HubError as HubError
from drafttrain.errors import first_line
from drafttrain.export.security import check_folder, scrub_text

UPLOADED_FILES = ("README.md", "config.json", "model.safetensors")


def resolve_token(token: str | None = None) -> str | None:
    """Explicit token, else the standard env vars, else the stored login; None when there is none."""
    if token:
        return token
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if os.environ.get(var):
            return os.environ[var]
    try:
        from huggingface_hub import get_token

        return get_token()
    except Exception:  # noqa: BLE001 - an unreadable login is the same as no login
        return None


def files_to_upload(folder: str | Path) -> list[str]:
    """The exact files an upload of `folder` sends (refuses pickles and unexpected files)."""
    folder = Path(folder)
    check_folder(folder)
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    extra = [f for f in files if f not in UPLOADED_FILES]
    missing = [f for f in UPLOADED_FILES if f not in files]
    if extra or missing:
        raise HubError(f"{folder} is not an export folder (missing {missing}, unexpected {extra}); "
                       "run `drafttrain export` into an empty folder first")
    return files


def push_to_hub(folder: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
                token: str | None = None) -> str:
    """Create (if needed) `repo_id` and upload `folder` in one commit; returns the commit URL.

    Raises HubError with one line when there is no token or the Hub cannot be reached.
    """
    from huggingface_hub import HfApi

    files = files_to_upload(folder)
    tok = resolve_token(token)
    if not tok:
        raise HubError("no Hugging Face token: set HF_TOKEN or run `hf auth login`; nothing was uploaded "
                       "(use --dry-run to write the folder without uploading)")
    api = HfApi(token=tok)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", revision=revision,
                                 allow_patterns=files,
                                 commit_message=f"drafttrain export ({', '.join(files)})")
    except Exception as e:  # noqa: BLE001 - offline, HTTP and auth errors all end the same way
        msg = scrub_text(first_line(e), (tok,))
        raise HubError(f"upload to {repo_id} failed ({type(e).__name__}: {msg}); nothing was uploaded") from None
    return scrub_text(str(getattr(info, "commit_url", info)), (tok,))
