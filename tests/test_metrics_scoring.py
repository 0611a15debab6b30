"""Metrics with the real scorers: pycocoevalcap PTB / METEOR (java) / CIDEr-D and MiniLM.

One `Scorers` (one METEOR JVM) serves the whole module; oracles call pycocoevalcap's
own `compute_score` on that same JVM, the way the public evaluators do.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

from pipeline.metrics import evaluate, public_result, write_report
from pipeline.metrics.common import nonsense_reference
from pipeline.metrics.scorers import Scorers, minilm_path
from pipeline.metrics.tiou import tiou

CAPTIONS = [
    "A man plays the guitar on a stage.",
    "A woman sings a song into a microphone.",
    "The crowd claps and cheers for the band.",
    "A dog runs across the green park.",
    "Two children play with a red ball in the park.",
    "The chef chops onions in the kitchen.",
    "A man rides a bicycle down the street.",
    "Rain falls on the window while soft music plays.",
]


@pytest.fixture(scope="module")
def sc():
    with Scorers() as scorers:
        scorers.start_meteor()
        yield scorers


def _dataset(seed: int = 3):
    rng = random.Random(seed)
    ref, pred = {}, {}
    for v in range(5):
        vid = f"vid{v}"
        bounds = sorted(rng.sample(range(1, 60), 4))
        times = [[0, bounds[0]]] + [[bounds[i], bounds[i + 1]] for i in range(3)]
        sents = [rng.choice(CAPTIONS) for _ in times]
        ref[vid] = {"duration": 60.0, "timestamps": times, "sentences": sents}
        if v == 4:
            continue  # no prediction for this video
        events = []
        for (s, e), cap in zip(times, sents):
            js, je = s + rng.uniform(-3, 3), e + rng.uniform(-3, 3)
            events.append({"timestamp": [max(0.0, js), max(js + 0.5, je)], "sentence": cap if rng.random() < 0.5 else rng.choice(CAPTIONS)})
        events.append({"timestamp": [0.0, 59.0], "sentence": rng.choice(CAPTIONS)})  # overlaps everything
        events.append({"timestamp": [70.0, 75.0], "sentence": rng.choice(CAPTIONS)})  # overlaps nothing
        pred[vid] = events
    return ref, {"results": pred}


# ---------------------------------------------------------------- scorers


def test_identical_captions_give_meteor_one(sc):
    (tok,) = sc.tokenize(["A zebra gallops across the dusty savanna."])
    assert tok == "a zebra gallops across the dusty savanna"
    assert sc.meteor_pair_scores([(tok, tok)]).tolist() == [1.0]
    assert sc.meteor_corpus_scores([[(tok, tok)]]).tolist() == [1.0]


def test_single_pair_cider_is_zero_but_a_corpus_is_not(sc):
    a, b, c = sc.tokenize(["zebra gallops across savanna", "violin melody echoes softly tonight", "thunderstorm approaches the quiet harbour"])
    # one pair: every n-gram has document frequency 1 = corpus size, so IDF log(1/1) = 0
    assert sc.cider_corpus_scores([[(a, a)]]).tolist() == [0.0]
    # three identical pairs with disjoint words: cosine 1 for n = 1..4, no length penalty -> 10
    assert sc.cider_corpus_scores([[(a, a), (b, b), (c, c)]])[0] == pytest.approx(10.0, abs=1e-9)


def test_batched_meteor_equals_compute_score_per_group(sc):
    rng = random.Random(0)
    toks = sc.tokenize(CAPTIONS)
    groups = [[(rng.choice(toks), rng.choice(toks)) for _ in range(rng.randint(1, 6))] for _ in range(8)]
    corpus = sc.meteor_corpus_scores(groups)
    meteor = sc.start_meteor()
    for group, got in zip(groups, corpus):
        gts = {k: [ref] for k, (_, ref) in enumerate(group)}
        res = {k: [hyp] for k, (hyp, _) in enumerate(group)}
        score, scores = meteor.compute_score(gts, res)
        assert got == score  # exactly the jar's corpus score for that group alone
        assert sc.meteor_pair_scores(group).tolist() == list(scores)


def test_tokenizer_runs_once_per_batch_of_new_captions(sc):
    before = sc.counters["ptb_calls"]
    sc.tokenize(["a brand new caption one", "a brand new caption two"])
    sc.tokenize(["a brand new caption one"])  # cached: no java
    assert sc.counters["ptb_calls"] == before + 1


@pytest.mark.slow  # loads a second copy of the model through sentence-transformers
def test_minilm_matches_sentence_transformers(sc):
    st = pytest.importorskip("sentence_transformers")
    sents = sc.tokenize(CAPTIONS[:4])
    ours = sc.embed(sents)
    ref = st.SentenceTransformer(str(minilm_path()), device="cpu").encode(sents)
    assert ours.shape == (4, 384)
    np.testing.assert_allclose(ours, ref, atol=1e-5)
    assert float(ours[0] @ ours[0]) == pytest.approx(1.0, abs=1e-6)


def test_meteor_jvm_is_closed():
    scorers = Scorers()
    proc = scorers.start_meteor().meteor_p
    assert proc.poll() is None
    scorers.close()
    assert proc.poll() is not None
    with Scorers() as other:
        proc = other.start_meteor().meteor_p
    assert proc.poll() is not None


# ---------------------------------------------------------------- protocols vs the public loops


def _public_densevid(ref: dict, pred: dict, tious, sc: Scorers, seed: int, missing: str) -> dict:
    """The ActivityNet/LongVALE evaluator's loops, straight: scalar tIoU, per-video compute_score."""
    texts = sorted({c for v in ref.values() for c in v["sentences"]} | {p["sentence"] for v in pred.values() for p in v})
    ptb = PTBTokenizer().tokenize({i: [{"caption": c}] for i, c in enumerate(texts)})
    tok = {c: ptb[i][0] for i, c in enumerate(texts)}
    meteor = sc.start_meteor()
    rows = []
    for t in tious:
        m, c, p_, r_ = [], [], [], []
        for vid, gt in ref.items():
            preds = pred.get(vid, [])
            if not preds:
                if missing == "zero":
                    m.append(0.0), c.append(0.0), p_.append(0.0), r_.append(0.0)
                continue
            res, gts, k = {}, {}, 0
            for i, p in enumerate(preds):
                added = False
                for j, ts in enumerate(gt["timestamps"]):
                    if tiou(p["timestamp"], ts) >= t:
                        res[k], gts[k], k, added = [tok[p["sentence"]]], [tok[gt["sentences"][j]]], k + 1, True
                if not added:
                    res[k], gts[k], k = [tok[p["sentence"]]], [nonsense_reference(seed, vid, i)], k + 1
            m.append(meteor.compute_score(gts, res)[0])
            c.append(Cider().compute_score(gts, res)[0])
            covered_p, covered_r = set(), set()
            for i, p in enumerate(preds):
                for j, ts in enumerate(gt["timestamps"]):
                    if tiou(p["timestamp"], ts) > t:
                        covered_p.add(i), covered_r.add(j)
            p_.append(len(covered_p) / len(preds)), r_.append(len(covered_r) / len(gt["timestamps"]))
        P, R = np.mean(p_), np.mean(r_)
        rows.append({"METEOR": np.mean(m), "CIDEr": np.mean(c), "Precision": P, "Recall": R, "F1": 2 * P * R / (P + R) if P + R else 0.0})
    return {k: float(np.mean([row[k] for row in rows])) for k in rows[0]}


@pytest.mark.parametrize("missing", ["skip", "zero"])
def test_densevid_equals_public_evaluator(sc, missing):
    ref, pred = _dataset()
    got = evaluate(pred, ref, "densevid", missing=missing, seed=7, scorers=sc)
    want = _public_densevid(ref, pred["results"], (0.3, 0.5, 0.7, 0.9), sc, 7, missing)
    assert got["protocol"] == "densevid" and got["variant"]["missing"] == missing
    assert got["counts"]["videos_averaged"] == (4 if missing == "skip" else 5)
    for name, value in want.items():
        assert got["metrics"][name] == pytest.approx(value, abs=1e-12), name
    assert 0 < got["metrics"]["METEOR"] < 1 and got["metrics"]["CIDEr"] > 0


def test_soda_end_to_end_hand_computed(sc):
    a, b, c = "zebra gallops across savanna", "violin melody echoes softly", "thunderstorm approaches harbour"
    toks = sc.tokenize([a, b, c])
    cross = sc.meteor_pair_scores([(x, y) for x in toks for y in toks if x != y])
    assert cross.max() == 0.0  # disjoint vocabularies: METEOR 0 across, 1 within
    ref = {"v": {"duration": 30, "timestamps": [[0, 10], [10, 20], [20, 30]], "sentences": [a, b, c]}}
    # sorted predictions: p0 [5,15] "b" (tIoU 1/3 with r1), p1 [8,20] "a" (tIoU 0.1 with r0),
    # p2 [20,30] "c" (tIoU 1 with r2). S = [[0, .1, 0], [1/3, 0, 0], [0, 0, 1]]; r0-p1 and
    # r1-p0 cross, so best = 1/3 + 1 = 4/3; P = R = 4/9, F = 4/9.
    pred = {"results": {"v": [{"timestamp": [20, 30], "sentence": c}, {"timestamp": [5, 15], "sentence": b}, {"timestamp": [8, 20], "sentence": a}]}}
    got = evaluate(pred, ref, "soda", scorers=sc)
    assert got["protocol"] == "soda"
    assert got["metrics"]["SODA_c"] == pytest.approx(4 / 9, abs=1e-7)
    assert got["per_video"]["v"]["matches"] == [[1, 1], [0, 2]]  # [pred, ref] in input order


def test_empty_predictions_under_both_missing_policies(sc):
    ref, pred = _dataset()
    for missing, averaged in (("skip", 0), ("zero", 5)):
        got = evaluate({"results": {}}, ref, "densevid", missing=missing, scorers=sc)
        assert got["counts"]["videos_averaged"] == averaged
        assert all(v == 0.0 for v in got["metrics"].values())
        assert got["counts"]["prediction_status"] == {"missing": 5}
    one = {"results": {"vid0": pred["results"]["vid0"]}}
    skip = evaluate(one, ref, "densevid", missing="skip", scorers=sc)["metrics"]
    zero = evaluate(one, ref, "densevid", missing="zero", scorers=sc)["metrics"]
    for name in ("METEOR", "CIDEr", "Precision", "Recall"):
        assert zero[name] == pytest.approx(skip[name] / 5, abs=1e-12)
    etb = evaluate({"results": {}}, ref, "etbench", scorers=sc)
    assert etb["metrics"] == {"F1": 0.0, "Sim": 0.0, "Precision": 0.0, "Recall": 0.0}
    assert evaluate({"results": {}}, ref, "soda", scorers=sc)["counts"]["videos_averaged"] == 0


def test_thousand_event_video(sc):
    n = 1000
    caps = [CAPTIONS[i % 4] for i in range(n)]
    ref = {"long": {"duration": float(n), "timestamps": [[i, i + 1] for i in range(n)], "sentences": caps}}
    events = [{"timestamp": [i + 0.1, i + 1.1], "sentence": caps[i]} for i in range(n)]
    events += [{"timestamp": [0, 1], "sentence": "beyond the cap"}] * 5  # 1,005 events: 5 cut
    got = evaluate({"results": {"long": events}}, ref, "padcaptioner", scorers=sc)
    assert got["counts"]["predicted_events"] == 1000 and got["counts"]["predicted_events_truncated"] == 5
    assert any("kept the first 1000" in m for m in got["videos"]["long"]["problems"])
    soda = got["components"]["soda"]["per_video"]["long"]
    assert len(soda["matches"]) == 1000  # each prediction with its own reference, in order
    assert got["metrics"]["SODA_c"] == pytest.approx(0.9 / 1.1, abs=1e-6)  # tIoU 0.9/1.1, METEOR 1
    assert got["metrics"]["F1"] == 1.0  # every tIoU(pred i, ref i) = 0.818 > 0.7
    assert got["components"]["densevid"]["per_threshold"]["0.9"]["Precision"] == 0.0


def _strip_volatile(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("timing_s", "scorer_calls")}


def test_determinism_across_runs(sc):
    ref, pred = _dataset()
    sc.clear_caches()  # embeddings made in other batches by earlier tests differ in the last bits
    first = evaluate(pred, ref, "padcaptioner", seed=1, scorers=sc)
    sc.clear_caches()  # recompute everything: tokens, METEOR statistics, embeddings
    second = evaluate(pred, ref, "padcaptioner", seed=1, scorers=sc)
    assert json.dumps(_strip_volatile(first), sort_keys=True) == json.dumps(_strip_volatile(second), sort_keys=True)
    other_seed = evaluate(pred, ref, "densevid", seed=2, scorers=sc)
    assert other_seed["variant"]["seed"] == 2  # nonsense strings differ, scores stay ~0 for them


def test_bad_predictions_are_reported_and_scale_etbench(sc):
    ref, pred = _dataset()
    results = dict(pred["results"])
    results["vid1"] = [{"timestamp": [9, 3], "sentence": "reversed"}, {"timestamp": ["x", 3], "sentence": "nan"}]
    results["vid2"] = results["vid2"] + [{"timestamp": [1, 2], "sentence": ""}, {"start": -4, "end": 2, "caption": "neg"}]
    results["ghost"] = [{"timestamp": [0, 1], "sentence": "who"}]
    got = evaluate({"results": results}, ref, "padcaptioner", scorers=sc)
    videos = got["videos"]
    assert videos["vid1"]["status"] == "unparsable" and len(videos["vid1"]["problems"]) == 3
    assert videos["vid2"]["status"] == "ok" and len(videos["vid2"]["problems"]) == 2
    assert videos["vid4"]["status"] == "missing"
    assert any(p["video_id"] == "ghost" for p in got["problems"])
    etb = got["components"]["etbench"]
    assert etb["counts"]["videos_parsed"] == 3 and etb["counts"]["parsed_scale"] == pytest.approx(3 / 5)
    clean = evaluate({"results": {k: v for k, v in results.items() if k in ("vid0", "vid2", "vid3")}}, ref, "etbench", scorers=sc)
    for t, row in etb["per_threshold"].items():  # same parsed videos, same scaling
        assert row == clean["per_threshold"][t]
    # densevid / SODA just drop what cannot be scored
    assert got["components"]["densevid"]["counts"]["videos_averaged"] == 3


def test_report_files_written(sc, tmp_path):
    ref, pred = _dataset()
    result = evaluate(pred, ref, "padcaptioner", scorers=sc)
    index = write_report(result, pred, ref, tmp_path / "report", max_videos=3)
    assert index == tmp_path / "report" / "index.html"
    html = index.read_text()
    assert "padcaptioner" in html and "SODA_c" in html and "vid0" in html
    pngs = sorted((tmp_path / "report" / "videos").glob("*.png"))
    assert len(pngs) == 3  # capped at max_videos
    for png in pngs + [tmp_path / "report" / "metrics.png"]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.dumps(public_result(result))  # JSON-ready


def _published_soda_c(sc, ref_caps, ref_times, pred_caps, pred_times, scorer) -> float:
    """SODA_c of one video computed the way fujiso/SODA's calc_score_matrix + soda_c do it:
    per reference caption g one `scorer.compute_score(res, gts)` call with res = the
    predictions and gts = g at every prediction index (so g is scored as the hypothesis)."""
    from pipeline.metrics.soda import soda_dp

    res = {i: [p] for i, p in enumerate(sc.tokenize(pred_caps))}
    rows = [scorer.compute_score(res, {i: [g] for i in range(len(pred_caps))})[1] for g in sc.tokenize(ref_caps)]
    score = np.asarray(rows, dtype=np.float64)  # [R, P]
    iou = np.array([[tiou(p, r) for p in pred_times] for r in ref_times])
    best, _ = soda_dp(iou * score)
    prec, rec = best / len(pred_caps), best / len(ref_caps)
    return 2 * prec * rec / (prec + rec) if prec + rec > 0 else 0.0


def test_soda_c_default_is_the_published_direction_documented_is_an_option(sc):
    ref_caps = ["a man plays the guitar on a big wooden stage under bright lights", "the crowd claps",
                "a dog runs across the park"]
    ref_times = [[0.0, 10.0], [10.0, 20.0], [20.0, 30.0]]
    pred_caps = ["a man plays guitar", "the crowd claps and cheers loudly for the band on the stage", "a dog runs",
                 "a red dog runs across the green park with a ball"]
    pred_times = [[0.0, 9.0], [9.0, 21.0], [19.0, 26.0], [24.0, 30.0]]  # sorted by start, like the references
    ref = {"v": {"duration": 30.0, "timestamps": ref_times, "sentences": ref_caps}}
    pred = {"results": {"v": [{"timestamp": t, "sentence": c} for t, c in zip(pred_times, pred_caps)]}}
    meteor = sc.start_meteor()
    published = _published_soda_c(sc, ref_caps, ref_times, pred_caps, pred_times, meteor)
    got = evaluate(pred, ref, "soda", scorers=sc, soda_cider=True)
    assert got["metrics"]["SODA_c"] == pytest.approx(published, abs=1e-9)
    assert got["variant"]["direction"].startswith("published (fujiso/SODA")
    # the published CIDEr variant: IDF per reference row over the video's predictions
    assert got["metrics"]["SODA_c_CIDEr"] == pytest.approx(
        _published_soda_c(sc, ref_caps, ref_times, pred_caps, pred_times, Cider()), abs=1e-9)

    documented = evaluate(pred, ref, "soda", scorers=sc, soda_cider=True, soda_direction="documented")
    # METEOR's own direction is the published computation with the two sides swapped
    hand = _published_soda_c(sc, pred_caps, pred_times, ref_caps, ref_times, meteor)
    assert documented["metrics"]["SODA_c"] == pytest.approx(hand, abs=1e-9)
    assert abs(documented["metrics"]["SODA_c"] - got["metrics"]["SODA_c"]) > 1e-3  # the direction matters here
    assert documented["variant"]["direction"].startswith("documented")
    assert abs(documented["metrics"]["SODA_c_CIDEr"] - got["metrics"]["SODA_c_CIDEr"]) > 1e-3
    assert evaluate(pred, ref, "padcaptioner", scorers=sc)["variant"]["SODA_c"].endswith(got["variant"]["direction"] + ")")
    with pytest.raises(ValueError, match="soda_direction"):
        evaluate(pred, ref, "soda", scorers=sc, soda_direction="sideways")
