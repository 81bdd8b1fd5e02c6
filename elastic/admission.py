"""Run admission: a job started with a join token admits only the nodes that prove they hold it.

Without a token the rendezvous trusts etcd's access control: anyone who can write under the run's
prefix can join the run (and get a rank) or disrupt it. Use etcd auth and TLS for that
(deploy/etcd/). With a token (`$ELASTIC_JOIN_TOKEN` or `--rdzv-conf join_token_file=PATH`, never
the command line), every record an agent of the run writes carries an HMAC-SHA256 keyed by the
token, and every agent checks the records it reads:

    <run>admission/run        {"version", "fingerprint"}: HMAC(token, run id), written once by the
                              first agent of a fresh run. An agent without the token, or with
                              another one, reads it and fails at once, before it registers.
    <run>admission/state      the MAC of the round state document, written in the same
                              transaction as every state write.
    <run>nodes/<id>  "proof"  MAC of (run id, node id, lease id, addr, beacon, pid). The lease id is
                              the record's real lease, so a copied record does not verify.
    <run>rdzv/store/<g> "proof"  MAC of (run id, generation, addr, port).
    tier-0 replica pushes        a MAC keyed by HMAC(token, run id, "replica") (`replica_key`), which the
                                 agent hands its checkpoint helper: a node's helper keeps only pushes
                                 that carry it (ckpt/replica.py), so a process without the token cannot
                                 put state into this run's tier 0.

A registration or store address whose proof does not verify is left out (not live, never in a
round, its beacon not watched), with a warning naming the key. A round state whose MAC does not
verify is an error naming the key: an admitted node never takes a rank from a state a stranger
wrote. The token itself is written nowhere; the fingerprint does not reveal it.

What the token does not stop: someone with write access to the etcd can still delete or replay
keys (a denial of service, not a way in), and the round's TCPStore and the process group's own
sockets (torch's) take connections without any authentication: bind them with --local-addr and
keep the job's network closed to others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
from collections.abc import Iterable, Mapping

from elastic.credentials import protect, read_secret_file
from elastic.errors import AdmissionError, EtcdRecordError
from elastic.keys import RunKeys
from elastic.records import KeyValue, RunRecords
from elastic.run_store import RunStore

log = logging.getLogger(__name__)

TOKEN_ENV = "ELASTIC_JOIN_TOKEN"
"""Environment variable the join token may come from (instead of `--rdzv-conf join_token_file=`)."""
MIN_TOKEN_LENGTH = 16
"""Shortest join token accepted: the fingerprint and the proofs in etcd must not be open to guessing."""
_VERSION = 1
_HOW_TO_SET = f"set ${TOKEN_ENV} or --rdzv-conf join_token_file=PATH"


def load_join_token(join_token_file: str | None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The run's join token from `join_token_file=` or `$ELASTIC_JOIN_TOKEN`; None: no admission.

    Raises ValueError naming the source when both are given, the file is bad, or the token is short.
    """
    environ = os.environ if environ is None else environ
    from_env = (environ.get(TOKEN_ENV) or "").strip()
    if join_token_file is not None and from_env:
        raise ValueError(f"both join_token_file= and ${TOKEN_ENV} are set; give the join token one way")
    if join_token_file is not None:
        token, source = (
            read_secret_file(join_token_file, key="join_token_file").strip(),
            f"join_token_file={join_token_file}",
        )
    elif from_env:
        token, source = from_env, f"${TOKEN_ENV}"
    else:
        return None
    if len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(
            f"the join token from {source} has {len(token)} characters; use at least {MIN_TOKEN_LENGTH} random ones, "
            "e.g. from `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )
    protect(token)
    return token.encode()


class Admission:
    """Signs what this agent writes under the run's prefix and checks what it reads (see the module doc)."""

    def __init__(self, run_id: str, keys: RunKeys, token: bytes | None) -> None:
        self.run_id = run_id
        self.keys = keys
        self.record_key = keys.admission_run
        self.state_mac_key = keys.admission_state
        self._token = token

    def __repr__(self) -> str:
        return f"Admission(run_id={self.run_id!r}, required={self.required})"

    @property
    def required(self) -> bool:
        """True when this agent has a join token (and so admits only agents that have it too)."""
        return self._token is not None

    # -- the MACs ------------------------------------------------------------------------------

    def _mac(self, *parts: object) -> str:
        assert self._token is not None, "only an agent with a join token signs"
        message = json.dumps([_VERSION, self.run_id, *parts], separators=(",", ":")).encode()
        return hmac.new(self._token, message, hashlib.sha256).hexdigest()

    def fingerprint(self) -> str:
        return self._mac("fingerprint")

    def node_proof(self, node_id: str, lease_id: int, doc: Mapping[str, object]) -> str:
        return self._mac("node", node_id, int(lease_id), doc.get("addr"), doc.get("beacon"), doc.get("pid"))

    def store_proof(self, generation: int, addr: str, port: int) -> str:
        return self._mac("store", int(generation), addr, int(port))

    def state_mac(self, value: bytes) -> str:
        return self._mac("state", hashlib.sha256(value).hexdigest())

    def replica_key(self) -> bytes | None:
        """The key that signs this run's tier-0 replica pushes between the nodes' checkpoint helpers
        (ckpt/replica.py), derived from the token (which the helpers never see); None without a token."""
        return bytes.fromhex(self._mac("replica")) if self._token is not None else None

    @staticmethod
    def _matches(expected: str, given: object) -> bool:
        if isinstance(given, bytes):
            given = given.decode(errors="replace")
        return isinstance(given, str) and hmac.compare_digest(expected, given)

    # -- writing -------------------------------------------------------------------------------

    def enforce(self, store: RunStore) -> None:
        """Before this agent registers: claim a fresh run for the token, or check that this agent may join.

        Raises `AdmissionError` when the run requires a token this agent lacks, requires another
        token, or was started without one while this agent has one.
        """
        if not self.required:
            if store.get(self.record_key) is not None:
                raise self._token_required()
            return
        record = json.dumps({"version": _VERSION, "fingerprint": self.fingerprint()})
        ok, value = store.create(self.record_key, record, absent=[self.keys.state])
        if ok:
            log.info("admission: run %s admits only agents with its join token (fingerprint at %s)",
                     self.run_id, self.record_key)
            return
        if value is None:
            raise AdmissionError(
                f"run {self.run_id!r} was started without a join token, but this agent has one. Start every agent "
                "of one job with the same token, or all without; or use a new --rdzv-id."
            )
        try:
            fingerprint = json.loads(value)["fingerprint"]
        except (ValueError, TypeError, KeyError):
            raise AdmissionError(
                f"run {self.run_id!r}: the admission record at {self.record_key} is malformed; this agent cannot "
                "tell whether its join token is the run's. Use a new --rdzv-id."
            ) from None
        if not self._matches(self.fingerprint(), fingerprint):
            raise AdmissionError(
                f"run {self.run_id!r} requires a join token, and this agent's is not the one the run was started "
                f"with. Give every agent of the job the same token ({_HOW_TO_SET}), or use a new --rdzv-id."
            )

    def state_absent(self) -> list[str]:
        """Keys that must not exist for a state write. An agent without a token may write only while no
        agent with one has claimed the run, so it cannot slip a write in after the claim."""
        return [] if self.required else [self.record_key]

    def state_puts(self, doc: str) -> dict[str, str]:
        """Keys to write in the same transaction as the state document `doc`: its MAC, with a token."""
        return {self.state_mac_key: self.state_mac(doc.encode())} if self.required else {}

    def sign_node(self, doc: dict[str, object], lease_id: int) -> dict[str, object]:
        """The membership record `doc` (under lease `lease_id`), with its proof if this agent has a token."""
        if not self.required:
            return doc
        return {**doc, "proof": self.node_proof(str(doc["node_id"]), lease_id, doc)}

    def sign_store(self, generation: int, addr: str, port: int) -> dict[str, object]:
        """The store address record of round `generation`, with its proof if this agent has a token."""
        doc: dict[str, object] = {"addr": addr, "port": port}
        if self.required:
            doc["proof"] = self.store_proof(generation, addr, port)
        return doc

    # -- reading -------------------------------------------------------------------------------

    def admit(self, records: RunRecords, kvs: Iterable[KeyValue]) -> RunRecords:
        """`records` as an agent of this run may use them: unproven nodes and stores moved to
        `skipped`, an unsigned state turned into `state_error`.

        An agent without a token raises `AdmissionError` once the run requires one (an agent with
        the token claimed it after this agent's own check).
        """
        by_key = {kv.key.decode(errors="replace"): kv for kv in kvs}
        if not self.required:
            if self.record_key in by_key:
                raise self._token_required()
            return records
        skipped = list(records.skipped)
        nodes = {}
        for node_id, node in records.nodes.items():
            if self._matches(self.node_proof(node_id, node.lease_id, node.doc), node.doc.get("proof")):
                nodes[node_id] = node
            else:
                key = self.keys.node(node_id)
                skipped.append(self._unproven(key, "a registration", by_key[key].mod_revision if key in by_key else 0))
        stores = {}
        for generation, store in records.stores.items():
            key = self.keys.store(generation)
            kv = by_key.get(key)
            proof = _field(kv.value, "proof") if kv is not None else None
            if self._matches(self.store_proof(generation, store.addr, store.port), proof):
                stores[generation] = store
            else:
                skipped.append(self._unproven(key, "a store address", kv.mod_revision if kv is not None else 0))
        state, state_error = records.state, records.state_error
        state_kv, mac_kv = by_key.get(self.keys.state), by_key.get(self.state_mac_key)
        if state is not None and state_kv is not None and not (
            mac_kv is not None and self._matches(self.state_mac(state_kv.value), mac_kv.value)
        ):
            state, state_error = (
                None,
                EtcdRecordError(
                    self.keys.state,
                    "it is not signed with this run's join token (an agent without the token wrote it, or it was "
                    "changed by hand), so no agent of this run takes a rank from it",
                    advice=f"Find out who writes under {self.keys.prefix} and use etcd auth and TLS (deploy/etcd/); "
                    f"then stop the job's agents and delete it with `etcdctl del {self.keys.state}`, or use a new "
                    "--rdzv-id",
                    mod_revision=state_kv.mod_revision,
                ),
            )
        return dataclasses.replace(records, nodes=nodes, stores=stores, state=state, state_error=state_error,
                                   skipped=tuple(skipped))

    def _unproven(self, key: str, what: str, mod_revision: int) -> EtcdRecordError:
        return EtcdRecordError(
            key,
            f"{what} without a valid proof of this run's join token (an agent without the token, or a forged record)",
            advice="It is ignored: that node gets no rank and its beacon is not watched. If it should join, give its "
                   f"agent the job's token ({_HOW_TO_SET})",
            mod_revision=mod_revision,
        )

    def _token_required(self) -> AdmissionError:
        return AdmissionError(f"run {self.run_id!r} requires a join token; {_HOW_TO_SET} (the job's token).")


def _field(value: bytes, name: str) -> object:
    try:
        doc = json.loads(value)
    except ValueError:
        return None
    return doc.get(name) if isinstance(doc, dict) else None
