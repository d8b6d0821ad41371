import torch, flash_attn.cute.interface as I
torch.manual_seed(0)
dev='cuda'; H=4; D=128; B=3; S=256
lens=[100, 0, 256]   # element 1 dead
q=torch.randn(B*S,H,D,device=dev,dtype=torch.bfloat16)
k=torch.randn_like(q); v=torch.randn_like(q); dout=torch.randn_like(q)
cu_q=torch.arange(0,(B+1)*S,S,dtype=torch.int32,device=dev)
# keys: packed valid first (static layout: total B*S, padding rows at end)
ck=[0]
for L in lens: ck.append(ck[-1]+(L if L else S))
cu_k=torch.tensor(ck,dtype=torch.int32,device=dev)
kw=dict(cu_seqlens_q=cu_q,cu_seqlens_k=cu_k,max_seqlen_q=S,max_seqlen_k=S,softmax_scale=D**-0.5)
# (a) dk/dv zeros: rows past cu_k[-1] untouched?
out,lse=I._flash_attn_fwd(q,k,v,**kw,return_lse=True)[:2]
dk0=torch.zeros_like(k); dv0=torch.zeros_like(v); dq0=torch.empty_like(q)
r=I._flash_attn_bwd(q,k,v,out,dout,lse,dq=dq0,dk=dk0,dv=dv0,**kw)
past=int(cu_k[-1])
print("a: rows past cu_k[-1]:", past, "of", B*S, "dk max there", dk0[past:].abs().max().item(), "dv", dv0[past:].abs().max().item(), "same object", r[1] is dk0)
# (b) seqused_q = 0 for the dead element
su=torch.tensor([S,0,S],dtype=torch.int32,device=dev)
o2=torch.full_like(q, 7.0)
res=I._flash_attn_fwd(q,k,v,**kw,seqused_q=su,return_lse=True,out=o2)
o2=res[0]; lse2=res[1]
print("b: out rows of dead element: max |x|", o2[S:2*S].abs().max().item(), "(7 = untouched)", "others equal", (o2[:S]-out[:S]).abs().max().item(), (o2[2*S:]-out[2*S:]).abs().max().item())
print("b: lse dead", lse2[:, S:2*S].flatten()[:4].tolist())
try:
    dq=torch.full_like(q,7.0); dk=torch.full_like(k,7.0); dv=torch.full_like(v,7.0)
    I._flash_attn_bwd(q,k,v,o2,dout,lse2,dq=dq,dk=dk,dv=dv,seqused_q=su,**kw)
    print("b: dq dead rows", dq[S:2*S].abs().max().item(), "dk of dead element's keys", dk[cu_k[1]:cu_k[2]].abs().max().item(), dv[cu_k[1]:cu_k[2]].abs().max().item(), "dk past", dk[past:].abs().max().item())
    print("b: dq others vs", (dq[:S]-r[0][:S]).abs().max().item(), (dk[:cu_k[1]]-r[1][:cu_k[1]]).abs().max().item())
except Exception as e:
    print("b bwd failed", type(e).__name__, str(e)[:300])
