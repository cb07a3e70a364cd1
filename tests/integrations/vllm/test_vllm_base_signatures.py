"""The signature record kvdi's 0.33 contract check reads (vLLM-free): the fixture's content and the comparison rule."""

from __future__ import annotations

import json

from tests.integrations.vllm.data.base_signatures import FIXTURE, mismatches, signatures_of_source

SOURCE = """
class KVConnectorBase_V1(ABC):
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: "KVTransferConfig") -> bool:
        return True

    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass

    @property
    def role(self):
        return self._role
"""


def test_the_fixture_records_vllm_033s_new_hooks() -> None:
    record = json.loads(FIXTURE.read_text())
    base = record["classes"]["KVConnectorBase_V1"]
    assert record["vllm"] == "0.33.0"
    assert base["supports_sleep_mode"] == {
        "kind": "classmethod",
        "abstract": False,
        "params": [["kv_transfer_config", "positional", False]],
    }
    assert base["unregister_kv_caches"]["params"] == base["restore_kv_caches"]["params"] == []
    assert base["start_load_kv"]["abstract"] and "request_finished_all_groups" in record["classes"]["SupportsHMA"]


def test_an_override_must_take_what_the_base_passes() -> None:
    base = signatures_of_source(SOURCE)["KVConnectorBase_V1"]
    assert base["role"]["kind"] == "property" and base["start_load_kv"]["abstract"]
    load = base["start_load_kv"]
    assert mismatches(load, {"kind": "method", "abstract": False, "params": load["params"]}) == []
    no_kwargs = {"kind": "method", "abstract": False, "params": [["forward_context", "positional", False]]}
    assert mismatches(load, no_kwargs) == ["no **kwargs, base has them"]
    renamed = {"kind": "method", "abstract": False, "params": [["ctx", "positional", False], ["kw", "var_keyword", 0]]}
    assert mismatches(load, renamed)[0].startswith("positional parameters ['ctx']")
    extra = [*load["params"], ["budget", "keyword_only", False]]
    assert mismatches(load, {"kind": "method", "abstract": False, "params": extra}) == [
        "required parameter 'budget' the base does not pass"
    ]
    assert mismatches(base["supports_sleep_mode"], {**base["supports_sleep_mode"], "kind": "method"})
