-- Argo CD health for leaderworkerset.x-k8s.io/v1 LeaderWorkerSet (LWS v0.10).
-- Progressing: the controller has not observed the latest spec yet, a rolling update runs, or
--   groups are still starting (image pulls and weight loading can take many minutes).
-- Degraded: an explicit Failed condition is True; or not all groups are ready while the controller
--   reports no progress (Progressing=False); or groups have been progressing for longer than
--   STUCK_AFTER_SECONDS (a group that crash-loops is recreated again and again, so it never
--   fails on its own; the Progressing condition keeps its lastTransitionTime meanwhile).
--   Needs os.time(): argocd-cm sets useOpenLibs for this kind.
-- Healthy: Available=True and every group ready and updated.
local STUCK_AFTER_SECONDS = 90 * 60  -- Ray wait (20 min) + weight loading (startup probe: 60 min)

-- RFC 3339 UTC timestamp ("2026-12-02T15:04:05Z") -> Unix seconds, independent of the local TZ.
local function epoch(ts)
  if ts == nil then return nil end
  local y, mo, d, h, mi, s = string.match(ts, "^(%d+)-(%d+)-(%d+)T(%d+):(%d+):(%d+)")
  if y == nil then return nil end
  y, mo, d = tonumber(y), tonumber(mo), tonumber(d)
  if mo <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = (mo + 9) % 12
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  local days = era * 146097 + doe - 719468
  return days * 86400 + tonumber(h) * 3600 + tonumber(mi) * 60 + tonumber(s)
end

local function condition(status, ctype)
  if status.conditions == nil then return nil end
  for _, c in ipairs(status.conditions) do
    if c.type == ctype then return c end
  end
  return nil
end

local function is_true(c) return c ~= nil and c.status == "True" end
local function is_false(c) return c ~= nil and c.status == "False" end
local function msg(c, fallback)
  if c ~= nil and c.message ~= nil and c.message ~= "" then return c.message end
  return fallback
end

local hs = {}
local status = obj.status
if status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the LeaderWorkerSet controller"
  return hs
end

local generation = obj.metadata.generation or 0
if status.observedGeneration ~= nil and status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the controller to observe generation " .. generation
  return hs
end

local want = 1
if obj.spec ~= nil and obj.spec.replicas ~= nil then want = obj.spec.replicas end
local ready = status.readyReplicas or 0
local updated = status.updatedReplicas or 0
local counts = ready .. "/" .. want .. " groups ready, " .. updated .. " updated"

local failed = condition(status, "Failed")
if is_true(failed) then
  hs.status = "Degraded"
  hs.message = msg(failed, "LeaderWorkerSet failed") .. " (" .. counts .. ")"
  return hs
end

local available = condition(status, "Available")
local progressing = condition(status, "Progressing")
local updating = condition(status, "UpdateInProgress")

if is_true(updating) then
  hs.status = "Progressing"
  hs.message = msg(updating, "Rolling update in progress") .. " (" .. counts .. ")"
  return hs
end

if is_true(available) and ready >= want and updated >= want then
  hs.status = "Healthy"
  hs.message = msg(available, "All groups ready") .. " (" .. counts .. ")"
  return hs
end

if is_false(progressing) and ready < want then
  hs.status = "Degraded"
  hs.message = msg(progressing, "Groups are not ready and not progressing") .. " (" .. counts .. ")"
  return hs
end

if is_true(progressing) and os ~= nil and os.time ~= nil then
  local since = epoch(progressing.lastTransitionTime)
  if since ~= nil and os.time() - since > STUCK_AFTER_SECONDS then
    hs.status = "Degraded"
    hs.message = "Groups not ready after " .. math.floor((os.time() - since) / 60) .. " min (" .. counts .. ")"
    return hs
  end
end

hs.status = "Progressing"
hs.message = msg(progressing, "Groups are starting") .. " (" .. counts .. ")"
return hs
