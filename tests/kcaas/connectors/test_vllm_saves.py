"""The vLLM connector's saves (kcaas/connectors/vllm_saves.py): a step's KV is copied out of vLLM's paged layers as
each layer is reported written, every layer is in the result of `finish` (reported or not), the result no longer
depends on vLLM's blocks once finish returned, and a save ending inside a vLLM block keeps only its own tokens."""

import threading

import numpy as np
import torch

from kcaas.connectors.vllm_blocks import PagedLayout, gather
from kcaas.connectors.vllm_saves import SaveQueue, StagedSaves
from kcaas.connectors.vllm_worker import Save

LAYERS, BLOCKS, HEADS, BLOCK, DIM = 3, 8, 2, 4, 3


def paged_pool():
    torch.manual_seed(7)
    layers = [torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM) for _ in range(LAYERS)]
    return layers, PagedLayout.of("cpu", layers[0])


def test_every_layer_is_copied_reported_or_not_and_the_copy_is_independent_of_vllms_blocks():
    layers, paged = paged_pool()
    staged = StagedSaves(lambda: (layers, paged))
    whole = Save(np.arange(2 * BLOCK, dtype=np.int32), 0, [5, 2])
    partial = Save(np.arange(BLOCK + 2, dtype=np.int32), 0, [1, 6])  # ends 2 tokens into block 6
    saves = [whole, partial]
    staged.layer_written(0, saves)  # the first layer reported begins the step's saves
    staged.layer_written(2, saves)  # layer 1 never reported: copied in finish
    expected = [gather(layers, paged, [5, 2]), gather(layers, paged, [1, 6])[:, :, : BLOCK + 2]]
    result = staged.finish(saves)
    assert staged.copied_late == 1
    for layer in layers:
        layer.fill_(float("nan"))  # vLLM reuses its blocks once the step is over
    assert [save for save, _ in result] == [whole, partial]
    for (_, kv), want in zip(result, expected, strict=True):
        assert torch.equal(kv, want)
    assert staged.finish([]) == []  # a step without saves


def test_a_step_whose_layers_were_never_reported_is_copied_whole_at_its_end():
    layers, paged = paged_pool()
    staged = StagedSaves(lambda: (layers, paged))
    save = Save(np.arange(2 * BLOCK, dtype=np.int32), 0, [4, 0])
    ((_, kv),) = staged.finish([save])
    assert staged.copied_late == LAYERS and torch.equal(kv, gather(layers, paged, [4, 0]))


def test_a_layer_is_copied_as_written_in_its_step():
    layers, paged = paged_pool()
    staged = StagedSaves(lambda: (layers, paged))
    saves = [Save(np.arange(BLOCK, dtype=np.int32), 0, [3])]
    for index in range(LAYERS):
        layers[index][3].fill_(float(index))  # the forward writes layer `index` ...
        staged.layer_written(index, saves)  # ... then reports it
    ((_, kv),) = staged.finish(saves)
    assert staged.copied_late == 0
    assert [float(kv[index].unique()) for index in range(LAYERS)] == [0.0, 1.0, 2.0]
    staged.layer_written(0, [])  # the next step saves nothing
    assert staged.finish([]) == []


def test_the_save_queue_drops_what_does_not_fit_and_sends_the_rest_in_order():
    sent: list[int] = []
    dropped = []
    gate = threading.Event()

    def put(save, kv):
        gate.wait(10)
        sent.append(save)

    saves = SaveQueue(put, limit_bytes=2 * 4 * 10, dropped=lambda: dropped.append(1))
    for tag in range(3):
        saves.submit(tag, torch.zeros(10))  # 40 bytes each: the third does not fit while two wait
    gate.set()
    saves.close(10)
    assert sent == [0, 1] and dropped == [1]


def test_the_engines_inference_tensors_are_copied_out_beside_its_forward():
    """vLLM runs its forward in inference mode, so its blocks and the buffers made on its thread are inference
    tensors; the copier thread (where that mode is off unless set) still copies every layer during the forward."""
    with torch.inference_mode():
        layers, paged = paged_pool()
        staged = StagedSaves(lambda: (layers, paged))
        saves = [Save(np.arange(BLOCK, dtype=np.int32), 0, [2])]
        for index in range(LAYERS):
            staged.layer_written(index, saves)
        ((_, kv),) = staged.finish(saves)
    assert staged.copied_late == 0 and torch.equal(kv, gather(layers, paged, [2]))
