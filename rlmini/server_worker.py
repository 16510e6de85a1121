"""Server-side code for `vllm serve --worker-extension-cls rlmini.server_worker.WorkerExtension`, needed only
by a CPU server of a model with tied embeddings (the built-in tiny model, Qwen2.5 up to 3B): vLLM's CPU
backend packs a private copy of the LM head for its GEMM when the model loads, and an in-place reload of the
shared embedding does not repack it (the tie itself holds: model_loader/reload/layerwise.py copies into the
original tensors). GPU servers read the shared tensor and need nothing. The methods are the worker's own,
called through /collective_rpc (rlmini/server.py::ServerEngine.push)."""
from rlmini.engine import _retie, _tied_groups


class WorkerExtension:
    def rlmini_repack_tied(self) -> int:
        """Redo the post-load step of each layer tied to another's parameter; returns the groups found."""
        model = self.model_runner.model
        groups = _tied_groups(model)
        _retie(model, groups)
        return len(groups)
