-- Argo CD health check for specpair.dev/SpeculativePair (Lua 5.1, as Argo CD runs it).
-- Install: see README.md next to this file. Tested by tests/unit/test_argocd_health.py
-- against status objects the operator wrote on a real apiserver.
--
-- Order matters:
--   1. no status yet                                                    -> Progressing
--   2. Degraded=True, computed from the current spec (the condition's
--      observedGeneration): invalid spec, rollout failed and rolled back,
--      does not fit, a child the apiserver refused, acceptance drift    -> Degraded
--   3. a status older than the spec (status.observedGeneration)         -> Progressing
--   4. Progressing=True (a rollout or a scale-up is under way)          -> Progressing
--   5. Ready=True (serving at the current revision)                     -> Healthy
--      (the message adds TargetOnly, or SpeculationEffective=False: still
--      serving the target's output, but the draft is not helping)
--   6. anything else (pods not ready yet)                               -> Progressing
local hs = {}

local function condition(status, kind)
  if status == nil or status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function say(c, fallback)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.reason .. ": " .. c.message
  end
  return fallback
end

local status = obj.status
local generation = obj.metadata.generation
if status == nil or status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the specpair operator to reconcile the pair"
  return hs
end
local function current(observed)
  return generation == nil or observed == nil or observed >= generation
end

local degraded = condition(status, "Degraded")
if degraded ~= nil and degraded.status == "True" and current(degraded.observedGeneration) then
  hs.status = "Degraded"
  hs.message = say(degraded, "Degraded")
  return hs
end

if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local progressing = condition(status, "Progressing")
if progressing ~= nil and progressing.status == "True" then
  hs.status = "Progressing"
  hs.message = say(progressing, "Progressing")
  return hs
end

local ready = condition(status, "Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = say(ready, "Ready")
  local headroom = condition(status, "HeadroomSufficient")
  if headroom ~= nil and headroom.status == "False" then
    -- Serving, but without speculation (the draft does not fit the GPU).
    hs.message = hs.message .. "; " .. say(headroom, "speculation is off")
  end
  local effective = condition(status, "SpeculationEffective")
  if effective ~= nil and effective.status == "False" and effective.reason ~= "SpeculationOff" then
    -- Still serving the target's output, but the draft does not speed it up.
    hs.message = hs.message .. "; the draft is not helping: " .. say(effective, effective.reason)
  end
  return hs
end

hs.status = "Progressing"
hs.message = say(ready, "Waiting for the pair to become Ready")
return hs
