"""Lab `parallelism`'s predicted Llama-3-70B curves (the measured half runs processes: see
tests/parallel for the engine it measures)."""

from servescope.labs.parallelism import predicted_70b


def test_predicted_70b_tp_curves_nvlink_keeps_cutting_pcie_flattens():
    curves = predicted_70b(16)
    for hw in ("H100-SXM", "H200"):
        decode = [curves[(hw, "nvlink4")][tp][0] for tp in (1, 2, 4, 8)]
        assert decode == sorted(decode, reverse=True) and decode[-1] < decode[0] / 4
    pcie, nv = curves[("H100-SXM", "pcie5")], curves[("H100-SXM", "nvlink4")]
    assert pcie[1] == nv[1]  # one GPU: no link
    assert pcie[8][0] > 2 * nv[8][0] and pcie[8][0] > pcie[4][0]  # over PCIe TP=8 no longer pays


def test_predicted_70b_pipelines_micro_batches_cut_prefill_not_decode():
    from servescope.labs.parallelism import predicted_70b_pipeline

    rows = {(pp, micro): (dec, pre) for pp, micro, dec, pre in predicted_70b_pipeline(16)}
    for pp in (2, 4, 8):
        one, cut = rows[(pp, 1)], rows[(pp, 2 * pp)]
        assert cut[1] < 0.8 * one[1]  # compute-bound prefill: the stages overlap
        assert cut[0] > one[0]  # memory-bound decode: each micro-batch reads the weights again
