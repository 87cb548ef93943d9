"""Is the induction score lost on the query side (question's ' is') or the key side (needle's ' ')?

Scores of the DCA run's and the 8k reference's query (last prompt token) against the DCA run's and the
reference's target key (the needle's ' ' after ' is'), all at the same relative position 1664 (the 8k run's
q/k are un-rotated from their absolute positions first), per layer, for the reference's strongest head;
also the cosine similarity of the two runs' q and k vectors (unrotated).
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
import torch

torch.set_num_threads(1)
import frozen_import  # noqa: F401
from rope_ext.hooks.attention import rotate

W = "/tmp/dca_puzzle_work/runs"
d = torch.load(f"{W}/dca8192.pt", weights_only=False)
r = torch.load(f"{W}/none8k_samedist.pt", weights_only=False)
inv = d["inv_freq"]
dn0, rn0 = d["meta"]["needle"][0], r["meta"]["needle"][0]
dq_pos, rq_pos = 16383, 8191
assert dq_pos - (dn0 + 4) == rq_pos - (rn0 + 4) == 1664


def unrot(x, p):  # x [heads, d] rotated at position p -> unrotated
    return rotate(x[:, None, None].transpose(0, 1), torch.tensor([-float(p)]), inv, 1.0)[0, :, 0]


def score(q, k, rel):  # q [d], k [d] unrotated -> (R(rel) q) . k / 8
    return float(rotate(q[None, None, None], torch.tensor([float(rel)]), inv, 1.0)[0, 0, 0].double() @ k.double()) * 0.125


print("layer head | q.k target @1664: q_dca k_dca | q_ref k_ref | q_dca k_ref | q_ref k_dca || cos(q_dca,q_ref) cos(k_dca,k_ref) | sink q_dca k_dca@8192, q_ref k_ref@8191")
for li in range(12, 30):
    dc, rc = d["layers"][li], r["layers"][li]
    g = dc["q"].shape[0] // dc["k"].shape[0]
    qd = dc["q"][:, 0]  # [h, d] unrotated
    kd = dc["k"][:, dn0 + 4]  # [hk, d]
    kd0 = dc["k"][:, 0]
    qr = unrot(rc["q"][:, 0], rq_pos)
    kr = unrot(rc["k"][:, rn0 + 4], rn0 + 4)
    kr0 = rc["k"][:, 0]  # position 0: unrotated already
    # the reference's strongest head on the target
    rs = (rc["q"][:, 0, None].double() @ rc["k"][:, : rq_pos + 1].repeat_interleave(g, 0).double().transpose(1, 2))[:, 0] * 0.125
    h = int(torch.softmax(rs, -1)[:, rn0 + 4].argmax())
    kh = h // g
    cq = float(torch.nn.functional.cosine_similarity(qd[h], qr[h], 0))
    ck = float(torch.nn.functional.cosine_similarity(kd[kh], kr[kh], 0))
    print(f"{li:5d} {h:4d} | {score(qd[h], kd[kh], 1664):7.2f} {score(qr[h], kr[kh], 1664):7.2f} {score(qd[h], kr[kh], 1664):7.2f} "
          f"{score(qr[h], kd[kh], 1664):7.2f} || {cq:6.3f} {ck:6.3f} | {score(qd[h], kd0[kh], 8192):6.2f} {score(qr[h], kr0[kh], 8191):6.2f}")
