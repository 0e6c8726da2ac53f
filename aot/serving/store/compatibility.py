"""What a task's bare name may change when another version starts answering it (a publish, a rollback, a route).

Consumers read a task's answers by its labels' positions (logits by index, a tag's id) and send it what its kind and
pair-ness expect: a version whose labels (names, order or count), kind or pair-ness differ from the current one's
breaks them without an error. So the writer refuses such a version unless asked (`--allow-label-change`), naming both
label lists; and a version whose dev score is lower than the current one's (on the same metric) is said, not refused.
Both read the meta the index keeps of each version (aot.serving.store.writer.META_KEYS): no version folder is opened.
"""

from __future__ import annotations

from aot.serving.store.reader import StoreError, meta_kind

SHOWN_LABELS = 50  # labels of each list a refusal names; beyond, how many more


class LabelChangeRefused(StoreError):
    """A version that would change what the task's consumers read, refused; nothing was written."""


def _labels(labels) -> str:
    if labels is None:
        return "no labels"
    shown = ", ".join(map(str, labels[:SHOWN_LABELS]))
    more = f", ... ({len(labels) - SHOWN_LABELS} more)" if len(labels) > SHOWN_LABELS else ""
    return f"{len(labels)} label(s) [{shown}{more}]"


def _pairs(meta: dict) -> str:
    return "text pairs" if meta.get("has_pair") else "single texts"


def current_version(entry) -> tuple[str, dict] | None:
    """A raw index entry's current version and its meta (None: no entry)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("folder"), str):
        return None
    meta = entry.get("meta")
    return entry["folder"], meta if isinstance(meta, dict) else {}


def changes(current: dict, new: dict) -> list[str]:
    """What `new` (a version's meta) changes of `current`'s for its consumers: its kind, pair-ness, labels (nothing
    when `current` has no meta: an entry from before the index kept it, unknown)."""
    if not current or "labels" not in current:
        return []
    found = []
    if meta_kind(current) != meta_kind(new):
        found.append(f"its kind from {meta_kind(current)} to {meta_kind(new)}")
    if bool(current.get("has_pair")) != bool(new.get("has_pair")):
        found.append(f"its input from {_pairs(current)} to {_pairs(new)}")
    if current.get("labels") != new.get("labels"):
        found.append(f"its labels from {_labels(current.get('labels'))} to {_labels(new.get('labels'))}")
    return found


def check_same_labels(name: str, current: tuple[str, dict] | None, new: tuple[str, dict], allow: bool,
                      what: str) -> None:
    """Refuse (LabelChangeRefused) `what` ("publishing", "rolling back to", "routing to") version `new` (version,
    meta) of task `name` when it changes what `current` (version, meta; None: the task is new) answers, unless
    `allow`."""
    if current is None or allow:
        return
    found = changes(current[1], new[1])
    if found:
        raise LabelChangeRefused(
            f"{what} {new[0]} would change {'; and '.join(found)} (the current version {current[0]}): every consumer "
            f"that reads {name}'s answers by label position or sends it {_pairs(current[1])} would break without an "
            "error. Nothing was changed: publish it under another name, or pass --allow-label-change if every "
            "consumer knows")


def dev_note(name: str, current: tuple[str, dict] | None, new: tuple[str, dict],
             relation: str = "the version it replaces") -> str | None:
    """A note when version `new` scores lower on the dev set than `current` (same metric), else None."""
    if current is None:
        return None
    (old_version, old), (version, meta) = current, new
    before, after = old.get("dev"), meta.get("dev")
    if not isinstance(before, (int, float)) or not isinstance(after, (int, float)) or after >= before:
        return None
    if old.get("metric") != meta.get("metric"):
        return None
    return (f"{name}: {version} scores dev {meta.get('metric')} {after:.4g}, below the {before:.4g} of {old_version}, "
            f"{relation}")
