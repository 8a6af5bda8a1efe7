"""After-the-fact checks of a community run, from the run dirs of all its volunteers.

In a swarm no filesystem is shared: every volunteer (``farlink swarm join``) writes only its own
run dir, and a volunteer killed with SIGKILL never comes back with that dir (a newcomer takes its
shard over). The audit therefore reads every volunteer's metrics, those of the departed included,
and judges the run as a whole.

**What "committed" means in community mode.** A volunteer has committed round ``r`` when every
member of its averaging group voted yes in the round's vote (hivemind's ``commit()`` returned
True for it): it applied the averaged outer update, its metrics record the round
(``kind == "sync"``, ``committed``, ``outer_step == r``) with the fingerprint of the state it now
holds, and it checkpoints that state in its own run dir. A newcomer's first round
(``kind == "join"``, before any inner step) is committed the same way and brings no tokens.
The *committed tokens* of a round are the tokens this volunteer trained since its previous
committed round (or its start): its pseudo-gradient over them went into the average with their
weight. A round in which the
volunteer was healed instead (it was behind and adopted an up-to-date peer's state) commits none
of its tokens: the work it did since its last commit was replaced, never averaged, and is counted
as *discarded*, as is the work a killed volunteer did after its last commit (*uncommitted work
lost with it*, which no scheme can keep).

**Zero committed tokens lost** then rests on three facts the audit checks:

1. every committed round has one fingerprint across all volunteers that logged it (killed ones
   included): no two states were ever committed under one round number. In groups smaller
   than the swarm (``--group-size``) each record names its group, and the rule holds per
   group: the groups' states are averaged together in later rounds (see
   :meth:`farlink.sync.diloco.DiLoCo.mix_group_states`), and the last round is one group;
2. the committed rounds form one sequence ``1..N`` with no gap;
3. every survivor (a volunteer whose run ended) ends on round ``N`` with round ``N``'s
   fingerprint.

Round ``r + 1`` is computed only from round ``r``'s state (a member that is behind heals to it
first), so the final state descends from every committed round, and every volunteer's committed
tokens are in it. Tokens committed into a round with two fingerprints, or into a round beyond
the survivors' final state, are what the audit counts as lost.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from farlink.train.metrics import read_metrics


def volunteer_record(run_dir: Path) -> dict:
    """One volunteer's life from its run dir: shard, committed rounds with their tokens, how it
    ended."""
    records = [r for path in sorted((run_dir / "metrics").glob("w*.jsonl"))
               for r in read_metrics(path)]
    claim_path = run_dir / "swarm.json"
    claim = json.loads(claim_path.read_text()) if claim_path.is_file() else {}
    rounds, discarded, tokens_at_commit, last_tokens = [], 0, 0, 0
    for r in records:
        if "tokens" in r and r["kind"] in ("step", "sync"):
            last_tokens = r["tokens"]
        if r["kind"] == "join" and r.get("committed"):
            # a newcomer's first round, before any inner step: it heals or averages nothing
            rounds.append({"round": r["outer_step"], "fingerprint": r["fingerprint"],
                           "tokens": 0, "healed": bool(r.get("healed")),
                           "world_size": r["world_size"], "time": r["time"]})
        elif r["kind"] == "sync" and r.get("committed"):
            since = r["tokens"] - tokens_at_commit
            healed = bool(r.get("healed"))
            rounds.append({"round": r["outer_step"], "fingerprint": r["fingerprint"],
                           "group": r.get("group"),
                           "tokens": 0 if healed else since, "healed": healed,
                           "world_size": r["world_size"], "time": r["time"]})
            discarded += since if healed else 0
            tokens_at_commit = r["tokens"]
    ends = [r for r in records if r["kind"] == "end"]
    positions = [r for r in records if r["kind"] == "data_position"]
    return {
        "run_dir": str(run_dir),
        "shard": claim.get("shard"),
        "join_round": claim.get("join_round"),
        "rounds": rounds,
        "committed_tokens": sum(r["tokens"] for r in rounds),
        "discarded_tokens": discarded,
        # trained after its last commit: gone with a volunteer that left without a word
        "uncommitted_tokens": last_tokens - tokens_at_commit,
        "end": ends[-1] if ends else None,
        # where it continued its shard from (its last holder's committed position), if it did
        "took_over_position_of_round": positions[-1]["round"] if positions else None,
    }


def audit_swarm(run_dirs: dict[str, Path]) -> dict:
    """Audit a community run from its volunteers' run dirs (name -> dir); see the module
    docstring for what is checked and what "committed" means."""
    volunteers = {name: volunteer_record(Path(d)) for name, d in run_dirs.items()}
    fingerprints: dict[int, set[str]] = defaultdict(set)
    by_group: dict[tuple[int, str | None], set[str]] = defaultdict(set)
    for v in volunteers.values():
        for r in v["rounds"]:
            fingerprints[r["round"]].add(r["fingerprint"])
            by_group[(r["round"], r.get("group"))].add(r["fingerprint"])
    last_round = max(fingerprints, default=0)
    # Moshpit groups (--group-size) commit one round apart by design; one group may not, and
    # the last round is one group of the whole swarm
    apart = {rd for (rd, _), f in by_group.items() if len(f) > 1}
    if len(fingerprints.get(last_round, ())) > 1:
        apart.add(last_round)
    divergent = {rd: sorted(fingerprints[rd]) for rd in sorted(apart)}
    missing = sorted(set(range(1, last_round + 1)) - set(fingerprints))

    survivors = sorted(n for n, v in volunteers.items() if v["end"] and v["end"].get("finished"))
    departed = sorted(n for n, v in volunteers.items() if v["end"] is None)
    final_states = {volunteers[n]["end"]["fingerprint"] for n in survivors}
    final_rounds = {volunteers[n]["end"]["outer_step"] for n in survivors}
    final_round = max(final_rounds, default=0)
    chain_head = next(iter(fingerprints.get(last_round, {None})))
    same_final_state = (bool(survivors) and len(final_states) == 1 and final_rounds == {last_round}
                        and not divergent and final_states == {chain_head})

    lost = sum(r["tokens"] for v in volunteers.values() for r in v["rounds"]
               if r["round"] in divergent or r["round"] > final_round)
    committed = sum(v["committed_tokens"] for v in volunteers.values())

    # a departed volunteer's shard: who trained it next, and from which committed round on
    hand_overs = []
    for name in departed:
        gone = volunteers[name]
        last = max((r["round"] for r in gone["rounds"]), default=0)
        # the next volunteer on that shard: the first whose rounds begin after the departed's
        heirs = sorted((min(r["round"] for r in v["rounds"]), n) for n, v in volunteers.items()
                       if n != name and v["shard"] == gone["shard"] and v["rounds"]
                       and min(r["round"] for r in v["rounds"]) > last)
        heir = heirs[0][1] if heirs else None
        hand_overs.append({
            "departed": name, "shard": gone["shard"], "last_committed_round": last,
            "uncommitted_tokens_lost": gone["uncommitted_tokens"], "picked_up_by": heir,
            "continued_from_round": volunteers[heir]["took_over_position_of_round"]
            if heir else None,
            # the heir's data position predates the departed's last commit when that commit's
            # position had not reached the DHT yet: those rounds' tokens are trained again
            "rounds_of_data_trained_again": last - volunteers[heir]["took_over_position_of_round"]
            if heir and volunteers[heir]["took_over_position_of_round"] is not None else None,
            # rounds the run still had after the departure (a claim expires 30 s after it)
            "rounds_left": last_round - last})

    return {
        "committed_rounds": last_round,
        "divergent_rounds": divergent,
        "missing_rounds": missing,
        "survivors": survivors,
        "departed": departed,
        "same_final_state": same_final_state,
        "final_fingerprint": next(iter(final_states)) if len(final_states) == 1 else None,
        "consistent": not divergent and not missing and same_final_state,
        "committed_tokens": committed,
        "lost_committed_tokens": lost,
        "discarded_tokens": sum(v["discarded_tokens"] for v in volunteers.values()),
        "uncommitted_tokens_lost_with_departed": sum(
            volunteers[n]["uncommitted_tokens"] for n in departed),
        "shard_hand_overs": hand_overs,
        "all_departed_shards_picked_up": all(h["picked_up_by"] for h in hand_overs),
        "volunteers": {n: {k: v[k] for k in ("shard", "join_round", "committed_tokens",
                                             "discarded_tokens", "uncommitted_tokens",
                                             "took_over_position_of_round")}
                       | {"committed_rounds": len(v["rounds"]),
                          "first_round": min((r["round"] for r in v["rounds"]), default=None),
                          "last_round": max((r["round"] for r in v["rounds"]), default=None),
                          "survived": n in survivors}
                       for n, v in volunteers.items()},
    }
