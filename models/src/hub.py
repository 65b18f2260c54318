"""The Hugging Face cache: a repo's snapshot folder at a revision, through huggingface_hub (downloaded as it
downloads when online; with HF_HUB_OFFLINE=1 only what is cached), and the one error for a name that gives
nothing. Below every reader of names: `runs.names` (models) and `saes.formats` (sparse autoencoders) ask here.
"""

from __future__ import annotations

from pathlib import Path

from interp.errors import UserError


class ModelNotFound(UserError, FileNotFoundError):
    """A name that resolves to no model: the message says what was tried and how to fix it."""


def hub_download(repo_id: str, revision: str | None, patterns: list[str], *, include: str | None = None) -> Path:
    """The snapshot folder of `repo_id` at `revision` holding the files that match `patterns`, through
    huggingface_hub's cache (offline, HF_HUB_OFFLINE=1: only what is cached); ModelNotFound, one line saying
    what is cached and how to fetch it, when it cannot be had. The SAE loader asks for one folder of a repo
    (`include`: the pattern the fetch command it suggests names, so that it fetches that folder alone)."""
    try:
        import huggingface_hub
        from huggingface_hub import errors as hub_errors
    except ImportError as e:
        raise ImportError(f"loading the repo {repo_id!r} needs huggingface_hub: pip install huggingface_hub") from e
    rev = revision or "main"
    fetch = (f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
             + (f" --include '{include}'" if include else ""))
    try:
        folder = Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except hub_errors.RevisionNotFoundError:
        raise ModelNotFound(f"{repo_id} has no revision {rev!r}; list its branches and tags on the Hub "
                            f"(Pythia names its checkpoints step0 ... step143000)") from None
    except hub_errors.RepositoryNotFoundError:
        raise ModelNotFound(f"no Hugging Face repo {repo_id!r} (or it is private: log in with `hf auth login`)") from None
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, OSError) as e:
        cached = cached_revisions(repo_id)
        have = f"; cached revisions: {', '.join(cached)}" if cached else "; nothing of it is cached"
        raise ModelNotFound(
            f"{repo_id} at revision {rev!r} is not in the Hugging Face cache ({huggingface_hub.constants.HF_HUB_CACHE}) "
            f"and cannot be downloaded ({'HF_HUB_OFFLINE is set' if huggingface_hub.constants.HF_HUB_OFFLINE else type(e).__name__}){have}. "
            f"Fetch it where there is a network: {fetch}"
        ) from None
    return folder


def cached_revisions(repo_id: str) -> list[str]:
    try:
        from huggingface_hub import scan_cache_dir

        for repo in scan_cache_dir().repos:
            if repo.repo_id == repo_id:
                return sorted({ref for rev in repo.revisions for ref in rev.refs} | {r.commit_hash[:8] for r in repo.revisions})
    except Exception:  # noqa: BLE001 - only for the hint in an error message
        pass
    return []
