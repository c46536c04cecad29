# Spills against the load where they left and where they went, rebuilt from
# kvbench's access logs (KVBENCH_ACCESS_LOG=DIR): python3 spills.py DIR
import json,glob,sys
from datetime import datetime
def load(pat):
    rs=[]
    for f in sorted(glob.glob(pat)):
        for l in open(f):
            if '"msg":"request"' not in l: continue
            d=json.loads(l)
            if d.get('method')!='POST' or not d.get('endpoint'): continue
            end=datetime.fromisoformat(d['ts'].replace('Z','+00:00')).timestamp()
            d['end']=end; d['start']=end-d.get('duration',0); d['first']=d['start']+d.get('ttfb',0)
            rs.append(d)
    rs.sort(key=lambda d:d['start'])
    return rs
def inflight(rs,ep,t):
    return sum(1 for d in rs if d['endpoint']==ep and d['start']<=t<d['end'])
def prefilling(rs,ep,t):
    return sum(1 for d in rs if d['endpoint']==ep and d['start']<=t<d['first'])
for pat in (sys.argv[1]+'/prefix-1-*.log',sys.argv[1]+'/prefix-8-*.log'):
    rs=load(pat)
    t0=rs[0]['start']
    last={}
    out=[]
    for d in rs:
        k=d.get('prefix_key')
        if d['reason']=='spill' and k in last:
            left=last[k]
            out.append((d['start']-t0, inflight(rs,left,d['start']), prefilling(rs,left,d['start']), inflight(rs,d['endpoint'],d['start'])))
        if k: last[k]=d['endpoint']
    print(pat,len(out))
    for o in out: print('  t=%.1f home_inflight=%d home_prefilling=%d target_inflight=%d'%o)
